"""The train/inference mismatch of --engine vllm on SmolLM2-135M-Instruct: vLLM's log-probs against the trainer's.

    python benchmarks/engine_mismatch.py          # float32 and bfloat16, 8 prompts x 8 completions, <= 128 tokens: ~3 min

One child process per dtype (one vLLM engine per process, and each its own peak memory). In it, as a script with
--engine vllm does: the policy is loaded in the dtype, vLLM starts in the process (start-up seconds) and takes the
policy's weights (push seconds); it samples the recipe's batch (held-out word problems, temperature 0.7, no top-k /
top-p), and the trainer's forward (common.rollout.token_logprobs, the scripts' first pass) scores the same tokens.
Reported over the completion tokens: mean and max |log pi_old - log mu|, the engine KL (k3 of KL(mu || pi_old)) and
the spread of w = pi_old / mu (common.engine.mismatch_metrics). The floor: the same measures for postrl's own
sampler (--engine hf), its batch sampled with the same prompts, against the same forward. Also each sampler's
tokens per second on this batch (one pass each, after the engine's start; a CPU's figure, not a GPU's).
Writes benchmarks/results/engine_mismatch.md. Needs vLLM (common/engine.py gives the install lines).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    prompts: int = 8
    generations: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.7
    data_dir: str = "data/word_problems"
    one: str | None = None
    """(internal) measure this dtype in this process and print one JSON line"""


def measure(args: Args, dtype: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import time

    t0 = time.perf_counter()
    import vllm  # noqa: F401  (its import is part of the start-up a script pays)

    import_s = time.perf_counter() - t0
    from common import word_problems
    from common.engine import Engine, mismatch
    from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
    from common.rollout import rollout
    from common.tasks import load_task

    if not (Path(args.data_dir) / "train.jsonl").is_file():
        word_problems.write(args.data_dir)
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path, dtype).eval(), load_tokenizer(path)
    task = load_task("gsm8k", f"{args.data_dir}/train.jsonl", f"{args.data_dir}/test.jsonl")
    prompts = [p for p in task.test["prompt"][: args.prompts] for _ in range(args.generations)]
    keys = [(0, 0, i // args.generations, i % args.generations) for i in range(len(prompts))]
    eos = eos_token_ids(model, tokenizer)
    engine = Engine(path, dtype, 1024, seed=0)
    push_s = engine.push(model)
    out = {"dtype": dtype, "import_s": import_s, "start_s": engine.start_s, "push_s": push_s}
    for name, sample in (("vllm", lambda: engine.rollout(tokenizer, prompts, keys, args.max_new_tokens, args.temperature, eos, "cpu")),
                         ("hf", lambda: rollout(model, tokenizer, prompts, keys, args.max_new_tokens, args.temperature, eos, "cpu"))):
        t0 = time.perf_counter()
        batch = sample()
        seconds = time.perf_counter() - t0
        tokens = batch.completion_mask.sum().item()
        out[name] = {**mismatch(model, batch, args.temperature, 0, 1.0), "tokens": tokens, "tokens_per_s": tokens / seconds}
    return out


def main(args: Args) -> None:
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    flags = ["--prompts", str(args.prompts), "--generations", str(args.generations), "--max-new-tokens",
             str(args.max_new_tokens), "--temperature", str(args.temperature), "--data-dir", args.data_dir]
    results = []
    for dtype in args.dtypes:
        child = subprocess.run([sys.executable, __file__, *flags, "--one", dtype], cwd=ROOT, capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"{dtype}: the child failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    lines = [f"`python benchmarks/engine_mismatch.py --dtypes {' '.join(args.dtypes)} {' '.join(flags)}`: SmolLM2-135M-Instruct, "
             f"{args.prompts} held-out word problems x {args.generations} completions, vLLM {vllm_version()} in the process; "
             "|log ratio| = |log pi_old - log mu| over the completion tokens, pi_old = the trainer's forward at the "
             "sampling weights, mu = the sampler's log-probs.", "",
             "| dtype | sampler | tokens | mean abs log ratio | max abs log ratio | engine KL (k3) | ratio std | tokens/s | "
             "vLLM import + engine start (s) | push (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("vllm", "hf"):
            m = r[name]
            start = f"{r['import_s']:.1f} + {r['start_s']:.1f} | {r['push_s']:.2f}" if name == "vllm" else "- | -"
            lines.append(f"| {r['dtype']} | {name} | {m['tokens']:.0f} | {m['offpolicy/engine_log_ratio_mean']:.2e} | "
                         f"{m['offpolicy/engine_log_ratio_max']:.2e} | {m['offpolicy/engine_kl']:.2e} | "
                         f"{m['offpolicy/engine_ratio_std']:.2e} | {m['tokens_per_s']:.0f} | {start} |")
    (ROOT / "benchmarks" / "results" / "engine_mismatch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main(tyro.cli(Args))
