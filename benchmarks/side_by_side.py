"""Two SmolLM2 runs side by side at one thread each, against one run at two threads: does a study finish its seeds
sooner two at a time (issue 54)?

    python benchmarks/side_by_side.py                     # ~20 minutes on 2 CPU cores, nothing else running

A study run's work in small: a training batch sampled (4 prompts x 8 completions, 128 new tokens, T 0.7), one training
forward and backward on it in 4 micro-batches of 2 groups (a policy-gradient loss on the completions' log-probs, through
the training forward grpo.py uses: common.rollout.token_logprobs), and an evaluation batch (--eval-prompts
prompts x 4 samples at T 0.7 with their greedy rows, one batch, as an evaluation samples them); base
SmolLM2-135M-Instruct, float32, the word problems' prompts. Three arms, alternating round after round, each child its
own process (its peak memory from os.wait4): `2 threads` (one process alone), `1 thread` (one process alone) and
`side by side` (two processes at one thread each, started together once both are warm). Each process warms up on one
pass of the work, then times --repeats passes. A pair's throughput against one process at two threads: 2 x its time
for the work / the side-by-side processes' time (above 1: two at a time finish more runs an hour). Writes
benchmarks/results/side_by_side.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
sys.path.insert(0, str(ROOT / "benchmarks"))
PARTS = ("sampling", "training", "evaluation")


@dataclass
class Args:
    rounds: int = 2
    repeats: int = 1
    """timed passes of the work in each process, after one warm-up pass"""
    eval_prompts: int = 25
    name: str = "side_by_side"
    child: str | None = None
    """(internal) the folder where a child process reports; its threads come from OMP_NUM_THREADS"""


def work(args: Args) -> None:
    """A child: warm up, say ready, wait for the go, time the work's parts, write them as JSON."""
    import torch

    from common.models import disable_dropout, eos_token_ids, load_model, load_tokenizer, resolve_model
    from common.rollout import micro_batches, rollout, token_logprobs
    from decode_profile import prompts

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(path), load_tokenizer(path)
    disable_dropout(model)
    eos = eos_token_ids(model, tokenizer)
    problems = prompts(max(4, args.eval_prompts))
    train_rows = [p for p in problems[:4] for _ in range(8)]
    eval_rows = [p for p in problems[: args.eval_prompts] for _ in range(4)] + problems[: args.eval_prompts]
    eval_temperature = [0.7] * (4 * args.eval_prompts) + [0.0] * args.eval_prompts

    def one_pass() -> dict[str, float]:
        seconds = {}
        t0 = time.perf_counter()
        batch = rollout(model, tokenizer, train_rows, [(0, i) for i in range(len(train_rows))], 128, 0.7, eos, "cpu")
        seconds["sampling"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.train()
        for mb in micro_batches(batch, 8, count=4):  # the study's --minibatches 4, through grpo.py's training forward
            logps, _ = token_logprobs(model, *mb.inputs, 0.7)
            (-(logps * mb.completion_mask).sum() / batch.completion_mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        seconds["training"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            rollout(model, tokenizer, eval_rows, [(1, i) for i in range(len(eval_rows))], 128, eval_temperature, eos, "cpu")
        seconds["evaluation"] = time.perf_counter() - t0
        return seconds

    one_pass()  # warm-up: the allocator, oneDNN's primitives
    folder = Path(args.child)
    (folder / f"ready_{os.getpid()}").touch()
    while not (folder / "go").exists():
        time.sleep(0.01)
    passes = [one_pass() for _ in range(args.repeats)]
    (folder / f"result_{os.getpid()}.json").write_text(json.dumps({k: sum(p[k] for p in passes) for k in PARTS}))


def arm(name: str, processes: int, threads: int, args: Args) -> list[dict]:
    """Start the arm's processes, let them go together once all are warm; each one's parts and peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--child", tmp, "--repeats", str(args.repeats), "--eval-prompts", str(args.eval_prompts)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        procs = [subprocess.Popen([sys.executable, __file__, *flags], cwd=ROOT, env=env) for _ in range(processes)]
        while len(list(Path(tmp).glob("ready_*"))) < processes:
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{name}: a child failed while warming up")
            time.sleep(0.1)
        (Path(tmp) / "go").touch()
        out = []
        for p in procs:
            _, status, usage = os.wait4(p.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"{name}: a child exited with status {os.waitstatus_to_exitcode(status)}")
            result = json.loads((Path(tmp) / f"result_{p.pid}.json").read_text())
            out.append({**result, "total": sum(result[k] for k in PARTS), "peak_rss_mb": usage.ru_maxrss / 1024})
    print(f"  {name}: " + ", ".join(f"{r['total']:.1f} s" for r in out), flush=True)
    return out


ARMS = {"2 threads": (1, 2), "1 thread": (1, 1), "side by side": (2, 1)}


def report(rounds: list[dict], args: Args) -> str:
    """The table over the rounds done so far (written after each round: a stopped sitting keeps them)."""
    from runner import cpu_model

    def median(name: str, key: str) -> float:  # over rounds and the arm's processes
        return statistics.median(r[key] for one in rounds for r in one[name])

    lines = [f"`python benchmarks/side_by_side.py --rounds {args.rounds} --repeats {args.repeats} --eval-prompts "
             f"{args.eval_prompts}`: SmolLM2-135M-Instruct, float32, {cpu_model()}, {os.cpu_count()} CPUs; medians over "
             f"{len(rounds)} of {args.rounds} alternating rounds (and over the processes of an arm)", "",
             "| arm | processes x threads | sampling (s) | training (s) | evaluation (s) | work (s) | peak RSS a process (MB) | "
             "runs an hour against 2 threads |", "|---|---|---|---|---|---|---|---|"]
    alone = median("2 threads", "total")
    for name, (p, t) in ARMS.items():
        total = median(name, "total")
        lines.append(f"| {name} | {p} x {t} | " + " | ".join(f"{median(name, k):.1f}" for k in PARTS) +
                     f" | {total:.1f} | {median(name, 'peak_rss_mb'):.0f} | {p * alone / total:.2f}x |")
    lines += ["", "Each round's work (s), arm by arm: " + "; ".join(
        f"round {i}: " + ", ".join(f"{name} " + " / ".join(f"{r['total']:.1f}" for r in one[name]) for name in ARMS)
        for i, one in enumerate(rounds))]
    return "\n".join(lines) + "\n"


def main(args: Args) -> None:
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    rounds = []
    for _ in range(args.rounds):
        rounds.append({name: arm(name, p, t, args) for name, (p, t) in ARMS.items()})
        out.write_text(report(rounds, args))
    print(out.read_text())


if __name__ == "__main__":
    parsed = tyro.cli(Args)
    work(parsed) if parsed.child else main(parsed)
