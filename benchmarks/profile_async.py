"""Where the learner and the generation thread of async_grpo.py spend their time, and whether the GIL serialises them.

    pip install py-spy                                   # Linux: needs ptrace rights over its own children
    python benchmarks/profile_async.py                   # embedded job, 60 steps: ~3 minutes on 2 CPU cores

Each job runs twice under py-spy, which samples every Python thread --rate times a second: once recording only
the samples in which a thread holds the GIL (`--gil`), once every sample in which it is running (py-spy leaves out
threads that are blocked: waiting for the GIL, a lock, a queue). Per training step, for each side:

    GIL s      the side's Python code running (the interpreter holds the GIL)
    active s   running, with or without the GIL (torch's kernels release it): active - GIL = work outside the GIL

The learner side is optimise() (forward, backward, AdamW) and the weight snapshot it publishes; the sampling side
is the generation thread's generate() (grpo.py: sample_groups(), in the same thread as training). If the two
sides' GIL seconds added up to the step time, the GIL would be what serialises them. Jobs: grpo.py, async_grpo.py
(K = 1, its default thread layout) and async_grpo.py with the generator given every core (--generator-threads
<cores>, the layout before). Writes benchmarks/results/profile_async.md.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.logging import read_metrics  # noqa: E402

QUIET = ["--eval-every", "0", "--eval-prompts", "8", "--eval-samples", "1", "--eval-k", "1", "--save-every", "100000"]
LEARNER = ("optimise (", "snapshot (")  # frames that mark a sample as the learner's step
SAMPLING = ("generate (async_grpo", "sample_groups (grpo")  # ... as sampling


@dataclass
class Args:
    steps: int = 60
    rate: int = 100
    """py-spy samples per second"""


def jobs() -> dict[str, list[str]]:
    cores = str(os.cpu_count() or 2)
    return {"grpo.py": ["grpo.py"],
            "async_grpo.py K = 1 (generator: 1 thread, the default on a CPU)": ["async_grpo.py"],
            f"async_grpo.py K = 1, --generator-threads {cores}": ["async_grpo.py", "--generator-threads", cores]}


def seconds_by_side(raw: Path, rate: int) -> dict[str, float]:
    """py-spy raw output (one 'frame;frame;... count' line per stack) -> seconds sampled on each side."""
    seconds = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        for side, marks in (("learner", LEARNER), ("sampling", SAMPLING)):
            if any(m in stack for m in marks):
                seconds[side] += int(count) / rate
    return seconds


def profile(argv: list[str], steps: int, rate: int, gil: bool, tmp: Path) -> tuple[dict[str, float], float]:
    """One job under py-spy: seconds per step on each side, and the loop's seconds per step."""
    run = tmp / ("gil" if gil else "active")
    raw = tmp / f"{run.name}.txt"
    cmd = ["py-spy", "record", "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(raw), *(["--gil"] if gil else []),
           "--", sys.executable, *argv, "--steps", str(steps), *QUIET, "--output-dir", str(tmp), "--run-name", run.name]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [r for r in read_metrics(run) if "time/train_s" in r]
    wait = "time/learner_wait_s" if "time/learner_wait_s" in rows[0] else "time/rollout_s"
    step_s = sum(r[wait] + r["time/train_s"] for r in rows) / len(rows)
    return {k: v / len(rows) for k, v in seconds_by_side(raw, rate).items()}, step_s


def main(args: Args) -> None:
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    lines = [f"`python benchmarks/profile_async.py --steps {args.steps} --rate {args.rate}`: embedded job (32 prompts x 8 "
             f"completions, <= 8 new tokens), {os.cpu_count()} CPU cores; seconds per training step.", "",
             "| job | step s | learner GIL s | learner active s | sampling GIL s | sampling active s | "
             "GIL held, both sides / step s |", "|---|---|---|---|---|---|---|"]
    for label, argv in jobs().items():
        with tempfile.TemporaryDirectory() as d:
            gil, step_gil = profile(argv, args.steps, args.rate, True, Path(d))
            active, step_active = profile(argv, args.steps, args.rate, False, Path(d))
        step_s = (step_gil + step_active) / 2
        held = (gil["learner"] + gil["sampling"]) / step_s
        lines.append(f"| {label} | {step_s:.3f} | {gil['learner']:.3f} | {active['learner']:.3f} | {gil['sampling']:.3f} | "
                     f"{active['sampling']:.3f} | {held:.2f} |")
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "profile_async.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
