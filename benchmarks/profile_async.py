"""Where the learner and the generation thread of async_grpo.py spend their time, and whether the GIL serialises them.

    pip install py-spy                                   # Linux: needs ptrace rights over its own children
    python benchmarks/profile_async.py                   # embedded job, 60 steps: ~4 minutes on 2 CPU cores

Each job runs twice under py-spy, which samples every Python thread --rate times a second: once recording only
the samples in which a thread holds the GIL (`--gil`), once every sample in which it is running (py-spy leaves out
threads that are blocked: waiting for the GIL, a lock, a queue). Per training step, for each side:

    GIL s      the side's Python code running (the interpreter holds the GIL)
    active s   running, with or without the GIL (torch's kernels release it): active - GIL = work outside the GIL

The learner side is optimise() (forward, backward, AdamW) and the weight snapshot it publishes; the sampling side
is the generation thread's generate() (grpo.py: sample_groups(), in the same thread as training). If the two
sides' GIL seconds added up to the step time, the GIL would be what serialises them. Jobs: grpo.py with torch's
intra-op threads and with one (OMP_NUM_THREADS=1: how much each phase gains from a second core), async_grpo.py
(K = 1, its default thread layout) and async_grpo.py with the generator given every core (--generator-threads
<cores>, the layout before). "sampling s" and "training s" are the runs' own time/rollout_s and time/train_s (for
async_grpo.py, sampling happens in the other thread, beside training). Writes benchmarks/results/profile_async.md.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro
from throughput import NO_EVAL_NO_SAVE, RESULTS, ROOT  # (importing it puts the repository root on sys.path)

from common.logging import read_metrics
LEARNER = ("optimise (", "snapshot (")  # frames that mark a sample as the learner's step
SAMPLING = ("generate (async_grpo", "sample_groups (grpo")  # ... as sampling


@dataclass
class Args:
    steps: int = 60
    rate: int = 100
    """py-spy samples per second"""


def jobs() -> dict[str, tuple[list[str], dict]]:
    """label: (argv, environment)."""
    cores = str(os.cpu_count() or 2)
    return {f"grpo.py ({cores} intra-op threads, torch's default)": (["grpo.py"], {}),
            "grpo.py (1 intra-op thread)": (["grpo.py"], {"OMP_NUM_THREADS": "1"}),
            "async_grpo.py K = 1 (generator: 1 thread, the default on a CPU)": (["async_grpo.py"], {}),
            f"async_grpo.py K = 1, --generator-threads {cores}": (["async_grpo.py", "--generator-threads", cores], {})}


def seconds_by_side(raw: Path, rate: int) -> dict[str, float]:
    """py-spy raw output (one 'frame;frame;... count' line per stack) -> seconds sampled on each side."""
    seconds = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        for side, marks in (("learner", LEARNER), ("sampling", SAMPLING)):
            if any(m in stack for m in marks):
                seconds[side] += int(count) / rate
    return seconds


def profile(argv: list[str], env: dict, steps: int, rate: int, gil: bool, tmp: Path) -> tuple[dict[str, float], dict]:
    """One job under py-spy: seconds per step on each side, and the run's own timings per step (loop, sampling, training)."""
    run = tmp / ("gil" if gil else "active")
    raw = tmp / f"{run.name}.txt"
    cmd = ["py-spy", "record", "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(raw), *(["--gil"] if gil else []),
           "--", sys.executable, *argv, "--steps", str(steps), *NO_EVAL_NO_SAVE, "--output-dir", str(tmp), "--run-name", run.name]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [r for r in read_metrics(run) if "time/train_s" in r]
    wait = "time/learner_wait_s" if "time/learner_wait_s" in rows[0] else "time/rollout_s"
    timing = {"step": sum(r[wait] + r["time/train_s"] for r in rows), "sampling": sum(r["time/rollout_s"] for r in rows),
              "training": sum(r["time/train_s"] for r in rows)}
    return {k: v / len(rows) for k, v in seconds_by_side(raw, rate).items()}, {k: v / len(rows) for k, v in timing.items()}


def main(args: Args) -> None:
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    lines = [f"`python benchmarks/profile_async.py --steps {args.steps} --rate {args.rate}`: embedded job (32 prompts x 8 "
             f"completions, <= 8 new tokens), {os.cpu_count()} CPU cores; seconds per training step.", "",
             "| job | step s | sampling s | training s | learner GIL s | learner active s | sampling GIL s | sampling active s | "
             "GIL held, both sides / step s |", "|---|---|---|---|---|---|---|---|---|"]
    for label, (argv, env) in jobs().items():
        with tempfile.TemporaryDirectory() as d:
            gil, timing_gil = profile(argv, env, args.steps, args.rate, True, Path(d))
            active, timing_active = profile(argv, env, args.steps, args.rate, False, Path(d))
        t = {k: (timing_gil[k] + timing_active[k]) / 2 for k in timing_gil}  # the two runs' means
        held = (gil["learner"] + gil["sampling"]) / t["step"]
        lines.append(f"| {label} | {t['step']:.3f} | {t['sampling']:.3f} | {t['training']:.3f} | {gil['learner']:.3f} | "
                     f"{active['learner']:.3f} | {gil['sampling']:.3f} | {active['sampling']:.3f} | {held:.2f} |")
        print(lines[-1], flush=True)
    out = RESULTS / "profile_async.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
