"""Where a SmolLM2 decode step's time goes, by operator: the matrix products, attention, the sampler's draw over the
vocabulary, and the rest (element-wise work, cache bookkeeping, Python), over whole batches as the studies sample them.

    python benchmarks/decode_profile.py                    # ~3 minutes on 2 CPU cores

Batches (the staleness study's recipe, base SmolLM2-135M-Instruct, float32, the word problems' prompts with the chat
template): a training batch (4 prompts x 8 completions, T 0.7), an evaluation batch (--eval-prompts prompts x 4 samples,
T 0.7) and its greedy pass (--eval-prompts rows). Each is sampled once to warm up, then once under torch.profiler with
--max-new-tokens decode steps at most. Each operator's self time (exclusive of the operators it calls) goes to one part:
products (mkldnn linear, mm, addmm, bmm), attention (scaled_dot_product_attention and what it runs), draw (the sampler's
draw(): log-softmax, the cumulative sum, the search, the output layer's chunks counted as products), and the rest; the
wall time per decode step beside them. Writes benchmarks/results/decode_profile.md.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

import common.sampling as sampling
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.sampling import encode_prompts, row_uniforms, sample

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
from runner import cpu_model  # noqa: E402

PRODUCTS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
ATTENTION = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_attention_math")


@dataclass
class Args:
    eval_prompts: int = 100
    max_new_tokens: int = 128
    batches: tuple[str, ...] = ("training", "evaluation", "greedy")
    name: str = "decode_profile"


def prompts(n: int) -> list[str]:
    """The first n held-out word problems as the recipe's runs prompt them (the gsm8k task's format)."""
    from common import word_problems
    from common.tasks import load_task

    folder = ROOT / "data" / "word_problems"
    if not (folder / "test.jsonl").exists():
        word_problems.write(folder)
    task = load_task("gsm8k", str(folder / "train.jsonl"), str(folder / "test.jsonl"))
    return list(task.test["prompt"][:n])


def part(name: str, in_draw: bool) -> str:
    if name in PRODUCTS:
        return "products"
    if name in ATTENTION or "attention" in name:
        return "attention"
    return "draw" if in_draw else "rest"


def profile(model, tokenizer, rows: list[str], temperature: float, max_new_tokens: int) -> dict:
    """One sample() of these rows under the profiler (after one unprofiled): seconds by part, decode steps, wall time."""
    eos = eos_token_ids(model, tokenizer)
    ids, mask = encode_prompts(tokenizer, rows, "cpu")
    uniforms = row_uniforms([(0, i) for i in range(len(rows))], max_new_tokens, "cpu") if temperature > 0 else None
    args = (model, ids, mask, max_new_tokens, temperature, eos, tokenizer.pad_token_id, uniforms)
    sample(*args)  # warm-up: allocator, oneDNN's primitives
    real_draw = sampling.draw

    def marked_draw(*a, **k):
        with torch.profiler.record_function("postrl::draw"):
            return real_draw(*a, **k)

    sampling.draw = marked_draw
    try:
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tokens, _ = sample(*args)
        wall = time.perf_counter() - t0
    finally:
        sampling.draw = real_draw
    events = prof.events()
    draws = [(e.time_range.start, e.time_range.end) for e in events if e.name == "postrl::draw"]
    seconds = defaultdict(float)
    for e in events:
        if e.name == "postrl::draw":
            continue
        inside = any(s <= e.time_range.start and e.time_range.end <= t for s, t in draws)
        seconds[part(e.name, inside)] += e.self_cpu_time_total / 1e6
    seconds["profiled"] = sum(seconds.values())
    return {"seconds": dict(seconds), "steps": tokens.shape[1], "wall": wall, "rows": len(rows)}


def main(args: Args) -> None:
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    problems = prompts(max(4, args.eval_prompts))
    batches = {"training": ([p for p in problems[:4] for _ in range(8)], 0.7),
               "evaluation": ([p for p in problems[: args.eval_prompts] for _ in range(4)], 0.7),
               "greedy": (problems[: args.eval_prompts], 0.0)}
    lines = [f"`python benchmarks/decode_profile.py --eval-prompts {args.eval_prompts} --max-new-tokens "
             f"{args.max_new_tokens}`: SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads, "
             f"{cpu_model()}", "",
             "| batch | rows | decode steps | wall (s) | ms a step | products | attention | draw | rest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in args.batches:
        rows, temperature = batches[name]
        r = profile(model, tokenizer, rows, temperature, args.max_new_tokens)
        s, total = r["seconds"], r["seconds"]["profiled"]
        share = {k: f"{1e3 * s.get(k, 0.0) / r['steps']:.1f} ms ({100 * s.get(k, 0.0) / total:.0f} %)"
                 for k in ("products", "attention", "draw", "rest")}
        lines.append(f"| {name} | {r['rows']} | {r['steps']} | {r['wall']:.1f} | {1e3 * r['wall'] / r['steps']:.0f} | "
                     f"{share['products']} | {share['attention']} | {share['draw']} | {share['rest']} |")
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
