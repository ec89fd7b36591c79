"""SmolLM2's matrix products through torch's CPU BLAS (MKL) and through oneDNN (common.models.onednn_linears): each
GEMM of a decode step and of a training step at its shapes, then a whole decode loop and a whole training step, the two
kernels alternating on the same model.

    python benchmarks/matmul_kernel.py          # ~4 minutes on 2 CPU cores

GEMMs: y = x W^T (forward), g W (the input's gradient) and g^T x (the weight's), as torch's linear and its backward
compute them and as OneDNNLinear does (transposed views, no copy), best of 5 timings of 5 calls each, the arms in turn.
Phases (--rounds rounds, the arms alternating, which goes first alternating too): the sampler on 4 training prompts x
8 rows for 64 tokens (no EOS: every step decodes 32 rows), and one training step (token_logprobs of the same
completions with the entropy, and its backward), in training mode, as the staleness study's recipe runs them. The
behaviour log-probs of the two arms are compared (float32 rounding). Writes benchmarks/results/matmul_kernel.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.models import _onednn, load_model, load_tokenizer, onednn_linears, resolve_model  # noqa: E402
from common.rollout import token_logprobs  # noqa: E402
from common.sampling import encode_prompts, row_uniforms, sample  # noqa: E402
from common.tasks import load_task  # noqa: E402


@dataclass
class Args:
    rounds: int = 3
    tokens: int = 64
    """decode steps in the sampling phase (and completion length in the training step)"""


def best(fn, reps: int = 5, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times)


def gemm_rows() -> list[str]:
    torch.manual_seed(0)
    shapes = [("decode: q, o", 32, 576, 576), ("decode: gate, up", 32, 576, 1536), ("decode: down", 32, 1536, 576),
              ("decode: output layer", 32, 576, 49152), ("training: gate, up", 3500, 576, 1536),
              ("training: down", 3500, 1536, 576), ("training: output layer chunk", 170, 576, 49152)]
    rows = []
    for name, M, K, N in shapes:
        x, w, g = torch.randn(M, K), torch.randn(N, K) * 0.05, torch.randn(M, N)
        flop = 2 * M * K * N
        products = {"forward": (lambda: torch.nn.functional.linear(x, w), lambda: _onednn(x, w)),
                    "input grad": (lambda: g @ w, lambda: _onednn(g, w.t())),
                    "weight grad": (lambda: g.t() @ x, lambda: _onednn(g.t(), x.t()))}
        cells = []
        for kind, (mkl, dnn) in products.items():
            if name.startswith("decode") and kind != "forward":
                continue
            a, b = best(mkl), best(dnn)
            cells.append(f"{kind} {flop / a / 1e9:.0f} / {flop / b / 1e9:.0f} ({a / b:.2f}x)")
        rows.append(f"| {name} | {M} x {K} x {N} | " + "; ".join(cells) + " |")
    return rows


def main(args: Args) -> None:
    torch.manual_seed(0)
    lines = [f"`python benchmarks/matmul_kernel.py --rounds {args.rounds} --tokens {args.tokens}`: SmolLM2-135M-Instruct, "
             f"float32, {torch.get_num_threads()} threads, torch {torch.__version__}", "",
             "GFLOP/s, torch's linear (MKL) / oneDNN (speed-up):", "",
             "| product | M x K x N | GFLOP/s torch / oneDNN |", "|---|---|---|", *gemm_rows()]
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    tokenizer, model = load_tokenizer(path), load_model(path)
    task = load_task("gsm8k", str(ROOT / "data/word_problems/train.jsonl"), str(ROOT / "data/word_problems/test.jsonl"))
    prompts = [p for p in task.train.select(range(4))["prompt"] for _ in range(8)]
    ids, mask = encode_prompts(tokenizer, prompts, "cpu")
    uniforms = row_uniforms([(0, i) for i in range(32)], args.tokens, "cpu")

    def decode():
        model.eval()
        return sample(model, ids, mask, args.tokens, 0.7, [-1], tokenizer.pad_token_id, uniforms)  # no EOS: 32 rows

    completions, _ = decode()
    ones = torch.ones_like(completions)

    def train_step():
        model.train()
        model.zero_grad()
        logps, _ = token_logprobs(model, ids, mask, completions, ones, 0.7, True)
        logps.sum().backward()

    times = {arm: {"decode": [], "train": []} for arm in ("torch", "onednn")}
    behaviour = {}
    for r in range(args.rounds):
        for arm in (("torch", "onednn") if r % 2 == 0 else ("onednn", "torch")):
            onednn_linears(model, on=arm == "onednn")
            t0 = time.perf_counter()
            behaviour[arm] = decode()
            times[arm]["decode"].append((time.perf_counter() - t0) / args.tokens * 1e3)
            t0 = time.perf_counter()
            train_step()
            times[arm]["train"].append(time.perf_counter() - t0)
            print(f"round {r} {arm}: decode {times[arm]['decode'][-1]:.1f} ms/step, train {times[arm]['train'][-1]:.2f} s",
                  flush=True)
    med = {arm: {k: statistics.median(v) for k, v in t.items()} for arm, t in times.items()}
    span = lambda v: f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]"  # noqa: E731
    lines += ["", f"Phases, median [min, max] over {args.rounds} alternating rounds:", "",
              "| arm | decode step, 32 rows (ms) | training step, 4 x 8 x "
              f"{args.tokens} tokens (s) |", "|---|---|---|"]
    lines += [f"| {arm} | {span(t['decode'])} | {span(t['train'])} |" for arm, t in times.items()]
    (a, la), (b, lb) = behaviour["torch"], behaviour["onednn"]
    same = (a == b).all(-1)
    diff = (la[same] - lb[same]).abs().max().item()
    lines += ["", f"oneDNN / torch: decode step {med['onednn']['decode'] / med['torch']['decode']:.2f}x, training step "
              f"{med['onednn']['train'] / med['torch']['train']:.2f}x. The two arms' completions: {int((~same).sum())} of "
              f"{len(same)} rows differ in some token (a draw flipped); the behaviour log-probs of the others differ by "
              f"at most {diff:.1e}"]
    out = ROOT / "benchmarks" / "results" / "matmul_kernel.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
