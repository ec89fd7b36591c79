"""The sampler on a study's evaluation batch, each prompt held once against each row's copy, alternating.

    python benchmarks/shared_prompt_sampler.py --rounds 2      # ~10 minutes on 2 CPU cores, nothing else running

The batch is the one a study's evaluation decodes (common.rollout.eval_rollouts): the first --eval-prompts held-out word
problems with the chat template, 4 samples each at T 0.7 with their evaluation keys, then one greedy row each, in one
batch at per-row temperatures; base SmolLM2-135M-Instruct, float32, --max-new-tokens at most. Arm `copies` is
sample(..., shared_prompt_rows=None): every row holds its own copy of its prompt's keys and values (PreallocatedLayer),
the sampler before this change; arm `once` holds each prompt once (SharedPromptLayer) and attends with prompt_once. The
arms alternate, round after round, after one warm-up sample of each. Reported: wall time and decode steps of each run,
the rows whose tokens differ between the arms' first runs (a draw flips where rounding moves a CDF boundary past its
uniform), and the largest log-prob difference on the rows that agree. Writes benchmarks/results/shared_prompt_sampler.md.

    python benchmarks/shared_prompt_sampler.py --memory        # ~5 minutes: each arm's peak memory, a process each

With --memory each arm samples the batch once in a process of its own, and its peak resident memory (the model, the
KV cache, the rest) is reported; appended to the same file.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.rollout import EVAL_KEY
from common.sampling import SHARED_PROMPT_ROWS, encode_prompts, row_uniforms, sample

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_profile import prompts  # noqa: E402
from runner import cpu_model, git  # noqa: E402

ARMS = {"copies": None, "once": 0}  # shared_prompt_rows


@dataclass
class Args:
    eval_prompts: int = 100
    samples: int = 4
    max_new_tokens: int = 128
    rounds: int = 2
    memory: bool = False
    """each arm once in a process of its own: its peak resident memory"""
    arm: str | None = None
    """(internal: the arm a --memory child process samples)"""
    name: str = "shared_prompt_sampler"


def memory(args: Args) -> None:
    peak = {}
    for arm in ARMS:
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--eval-prompts", str(args.eval_prompts),
                              "--max-new-tokens", str(args.max_new_tokens)], capture_output=True, text=True, check=True)
        peak[arm] = float(out.stdout.split("peak_rss_mb")[-1])
        print(f"  {arm}: peak {peak[arm]:.0f} MB", flush=True)
    lines = ["", f"`python benchmarks/shared_prompt_sampler.py --memory --eval-prompts {args.eval_prompts}`: commit "
                 f"{git('rev-parse', '--short', 'HEAD')}, {cpu_model()}; one sample of the batch in a process of its own",
             "", "| arm | peak resident memory (MB) |", "|---|---|", *(f"| {arm} | {mb:.0f} |" for arm, mb in peak.items())]
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text((out.read_text() if out.exists() else "") + "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(args: Args) -> None:
    if args.memory:  # each arm in a child process; this one loads nothing
        memory(args)
        return
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    problems = prompts(args.eval_prompts)
    rows = [p for p in problems for _ in range(args.samples)] + problems  # as eval_rollouts batches them
    keys = [(0, EVAL_KEY, i, j) for i in range(len(problems)) for j in range(args.samples)] + [(0,)] * len(problems)
    temperature = torch.tensor([0.7] * (len(rows) - len(problems)) + [0.0] * len(problems))
    ids, mask = encode_prompts(tokenizer, rows, "cpu")
    uniforms = row_uniforms(keys, args.max_new_tokens, "cpu")
    eos = eos_token_ids(model, tokenizer)

    def run(arm: str) -> tuple[float, torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        tokens, logps = sample(model, ids, mask, args.max_new_tokens, temperature, eos, tokenizer.pad_token_id, uniforms,
                               shared_prompt_rows=ARMS[arm])
        return time.perf_counter() - t0, tokens, logps

    if args.arm is not None:  # a --memory child: one sample of one arm, then its peak resident memory (kB on Linux)
        run(args.arm)
        print(f"peak_rss_mb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
        return
    for arm in ARMS:  # warm-up: allocator, oneDNN's primitives
        run(arm)
    results = []
    for r in range(args.rounds):
        for arm in ARMS:
            wall, tokens, logps = run(arm)
            results.append((arm, r, wall, tokens, logps))
            print(f"  {arm} round {r}: {wall:.1f} s, {tokens.shape[1]} decode steps", flush=True)
    wall = {arm: [w for a, _, w, *_ in results if a == arm] for arm in ARMS}
    first = {arm: next((t, lp) for a, _, _, t, lp in results if a == arm) for arm in ARMS}
    T = max(t.shape[1] for t, _ in first.values())  # (a batch ends when its last row does: pad the shorter run)
    (ta, la), (tb, lb) = ((torch.nn.functional.pad(t, (0, T - t.shape[1]), value=tokenizer.pad_token_id),
                           torch.nn.functional.pad(lp, (0, T - lp.shape[1]))) for t, lp in first.values())
    differ = (ta != tb).any(-1)
    sampled, greedy = differ[: -len(problems)], differ[-len(problems) :]
    largest = (la[~differ] - lb[~differ]).abs().max().item() if not differ.all() else float("nan")
    median = {arm: statistics.median(w) for arm, w in wall.items()}
    lines = [f"`python benchmarks/shared_prompt_sampler.py --eval-prompts {args.eval_prompts} --rounds {args.rounds}`: "
             f"commit {git('rev-parse', '--short', 'HEAD')}; SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} "
             f"threads, {cpu_model()}; {len(rows)} rows ({len(problems)} prompts x {args.samples} samples at T 0.7 and "
             f"a greedy row each), {args.max_new_tokens} new tokens at most; the sampler holds each prompt once from "
             f"{SHARED_PROMPT_ROWS} rows", "",
             "| arm | round | wall (s) | decode steps | s a step |", "|---|---|---|---|---|"]
    for arm, r, w, tokens, _ in results:
        lines.append(f"| {arm} | {r} | {w:.1f} | {tokens.shape[1]} | {w / tokens.shape[1]:.2f} |")
    lines += ["", f"once / copies (medians): {median['once'] / median['copies']:.2f}x "
                  f"({median['copies']:.1f} -> {median['once']:.1f} s)", "",
              f"First runs compared: {int(sampled.sum())} of {len(sampled)} sampled and {int(greedy.sum())} of "
              f"{len(greedy)} greedy rows differ in some token; on the rows that agree the log-probs differ by at most "
              f"{largest:.1e}"]
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
