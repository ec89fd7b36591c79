"""Two cuts to postrl's decode step measured before building them, for issue 54 (what vLLM's CPU engine does that
postrl's sampler does not). Nothing here changes a model; it says whether each is worth building.

    python benchmarks/fused_projections.py        # ~1 minute on 2 CPU cores

1. Fused projections, as vLLM holds them: one SmolLM2 layer's products at decode shapes, as the model calls them (q,
   k, v apart; gate and up apart) and fused (one q|k|v product, one gate|up product), through the kernel postrl's
   sampler uses (oneDNN's float32 linear: common.models._onednn). For M in --rows (the rows still sampling: a training
   batch's 32, an evaluation's 100 greedy and 400 sampled): each way's time for one layer (median of --reps, after a
   warm-up), the fused way's share, and what the difference comes to over a decode step's 30 layers.
2. Left padding: postrl's batch holds every prompt left-padded to the batch's longest, and attention reads the padded
   positions (masked); vLLM's paged attention reads none. The share of attention's positions that are padding at
   new tokens 1, 64 and 128, over the staleness study's training batch and evaluation prompts (counted from the
   tokenized prompts; no timing).
Writes benchmarks/results/fused_projections.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from common.models import _onednn, load_tokenizer, resolve_model
from common.sampling import encode_prompts
from decode_profile import prompts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
from runner import cpu_model  # noqa: E402

HIDDEN, KV, MLP, LAYERS = 576, 192, 1536, 30


@dataclass
class Args:
    reps: int = 30
    rows: tuple[int, ...] = (32, 100, 400)


def seconds(f, reps: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(args: Args) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(HIDDEN, HIDDEN), torch.randn(KV, HIDDEN), torch.randn(KV, HIDDEN)
    gate, up = torch.randn(MLP, HIDDEN), torch.randn(MLP, HIDDEN)
    qkv, gate_up = torch.cat([q, k, v]), torch.cat([gate, up])
    lines = [f"`python benchmarks/fused_projections.py --reps {args.reps}`: one SmolLM2 layer's products by oneDNN's "
             f"float32 linear, {torch.get_num_threads()} threads, {cpu_model()}; ms, medians of {args.reps}", "",
             "| rows M | q, k, v apart | q\\|k\\|v fused | fused / apart | gate, up apart | gate\\|up fused | fused / apart | "
             "saved a decode step (30 layers, ms) |", "|---|---|---|---|---|---|---|---|"]
    for M in args.rows:
        x = torch.randn(M, HIDDEN)
        fused = _onednn(x, qkv)
        apart = torch.cat([_onednn(x, q), _onednn(x, k), _onednn(x, v)], -1)
        assert torch.allclose(fused, apart, rtol=1e-4, atol=1e-3), (fused - apart).abs().max()
        a1 = seconds(lambda: (_onednn(x, q), _onednn(x, k), _onednn(x, v)), args.reps)
        f1 = seconds(lambda: _onednn(x, qkv), args.reps)
        a2 = seconds(lambda: (_onednn(x, gate), _onednn(x, up)), args.reps)
        f2 = seconds(lambda: _onednn(x, gate_up), args.reps)
        lines.append(f"| {M} | {1e3 * a1:.3f} | {1e3 * f1:.3f} | {f1 / a1:.2f}x | {1e3 * a2:.3f} | {1e3 * f2:.3f} | "
                     f"{f2 / a2:.2f}x | {1e3 * LAYERS * (a1 - f1 + a2 - f2):.1f} |")
        print(lines[-1], flush=True)
    lines += ["", "Left padding: the share of the positions attention reads that are padding (masked), at new token t", "",
              "| batch | rows | longest prompt | mean prompt | t = 1 | t = 64 | t = 128 |", "|---|---|---|---|---|---|---|"]
    tokenizer, problems = load_tokenizer(resolve_model("smollm2-135m-instruct", "gsm8k")), prompts(100)
    for name, rows in (("training (4 x 8)", [p for p in problems[:4] for _ in range(8)]), ("evaluation (100)", problems)):
        mask = encode_prompts(tokenizer, rows, "cpu")[1]
        L, mean = mask.shape[1], mask.sum(1).double().mean().item()
        lines.append(f"| {name} | {len(rows)} | {L} | {mean:.1f} | " + " | ".join(f"{1 - (mean + t) / (L + t):.1%}" for t in (1, 64, 128)) + " |")
    out = ROOT / "benchmarks" / "results" / "fused_projections.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
