"""Where a SmolLM2 decode step's matrix time goes: each projection's GEMM at decode shapes, against the GEMM rate of a
large product, measured in one run.

    python benchmarks/decode_gemms.py          # ~1 minute on 2 CPU cores

A decode step multiplies M rows (the rows still sampling) by every weight of the model once: per layer q and o
(576 x 576), k and v (576 x 192), gate and up (576 x 1536), down (1536 x 576), and the output layer (576 x 49152).
For M in {1, 16, 32, 64}: each shape's time (torch.nn.functional.linear, as the model calls it; median of --reps), its
GFLOP/s, and the whole step's matrix time (30 layers and the output layer) against the arithmetic floor at the large
GEMM's rate and the bytes floor (the float32 weights read once) at the measured read bandwidth; and the output
layer computed two other ways (W^T stored contiguous; the vocabulary by chunks). Writes
benchmarks/results/decode_gemms.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

LAYER = {"q, o": ((576, 576), 2), "k, v": ((576, 192), 2), "gate, up": ((576, 1536), 2), "down": ((1536, 576), 1)}
HEAD, LAYERS = (576, 49152), 30


@dataclass
class Args:
    reps: int = 50
    rows: tuple[int, ...] = (1, 16, 32, 64)


def linear_seconds(M: int, K: int, N: int, reps: int) -> float:
    x, w = torch.randn(M, K), torch.randn(N, K)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def head_variants(M: int, reps: int) -> tuple[float, float]:
    """The output layer two other ways: x @ W^T with W^T stored contiguous, and by chunks of 2,048 vocabulary rows."""
    x, w = torch.randn(M, HEAD[0]), torch.randn(HEAD[1], HEAD[0])
    wt, chunks = w.t().contiguous(), w.split(2048)
    out = []
    for f in (lambda: x @ wt, lambda: torch.cat([torch.nn.functional.linear(x, c) for c in chunks], -1)):
        for _ in range(3):
            f()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


def main(args: Args) -> None:
    big = linear_seconds(2048, 576, 1536, 20)
    rate = 2 * 2048 * 576 * 1536 / big
    x = torch.ones(128 * 2**20)
    bandwidth = max(x.numel() * 4 / (lambda t0: (x.sum(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    params = LAYERS * sum(K * N * n for (K, N), n in LAYER.values()) + HEAD[0] * HEAD[1]
    lines = [f"Large GEMM (2048 x 576 x 1536): {rate / 1e9:.0f} GFLOP/s; read bandwidth {bandwidth / 1e9:.0f} GB/s; "
             f"{torch.get_num_threads()} threads", "",
             "| rows M | " + " | ".join(f"{name} (us, GFLOP/s)" for name in [*LAYER, "output layer"]) +
             " | step's matrix time | arithmetic floor | bytes floor | output layer's share | output layer as x @ W^T, "
             "by chunks of 2,048 (us) |",
             "|---|" + "---|" * (len(LAYER) + 6)]
    for M in args.rows:
        cells, total = [], 0.0
        for (K, N), n in [*LAYER.values(), (HEAD, 1)]:
            s = linear_seconds(M, K, N, args.reps if N < 10000 else max(5, args.reps // 5))
            cells.append(f"{s * 1e6:.0f}, {2 * M * K * N / s / 1e9:.0f}")
            total += s * n * (LAYERS if (K, N) != HEAD else 1)
        head = linear_seconds(M, *HEAD, max(5, args.reps // 5))
        transposed, chunked = head_variants(M, max(5, args.reps // 5))
        lines.append(f"| {M} | " + " | ".join(cells) + f" | {total * 1e3:.1f} ms | {2 * M * params / rate * 1e3:.1f} ms | "
                     f"{params * 4 / bandwidth * 1e3:.1f} ms | {head / total:.0%} | {transposed * 1e6:.0f}, {chunked * 1e6:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(__file__).resolve().parent / "results" / "decode_gemms.md").write_text(text)


if __name__ == "__main__":
    main(tyro.cli(Args))
