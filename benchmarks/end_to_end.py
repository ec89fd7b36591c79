"""End to end: `python grpo.py` against `python async_grpo.py` as a user runs them, wall clock from start to exit.

    python benchmarks/end_to_end.py                        # the default embedded job, 200 steps, 3 rounds: ~8 minutes
    python benchmarks/end_to_end.py --rounds 2 --flags="--steps 60"

Every run is its own process, one at a time, in rounds (grpo.py, then async_grpo.py at each --staleness K, then
the next round), with the scripts' own defaults (evaluation every 10 steps, checkpoints) plus --flags for all of
them. Reported per script: wall seconds (start-up, training, every evaluation, the checkpoints), the ratio to the
grpo.py run of the same round (the machine's speed drifts between rounds), and the final eval/pass@1.
Writes benchmarks/results/end_to_end.md (or --name).
"""

from __future__ import annotations

import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from throughput import RESULTS, run_child  # (importing it puts the repository root on sys.path)

from common.logging import read_metrics


@dataclass
class Args:
    rounds: int = 3
    staleness: list[int] = field(default_factory=lambda: [1])
    """K of the async_grpo.py runs (its default is 1)"""
    flags: str = ""
    """extra flags for every run, one string (--flags="--steps 60")"""
    name: str = "end_to_end"


def timed_run(argv: list[str], run_dir: Path) -> tuple[float, float]:
    """Wall seconds of one run, and its final eval/pass@1."""
    wall, _ = run_child([sys.executable, *argv, "--output-dir", str(run_dir.parent), "--run-name", run_dir.name])
    return wall, [r for r in read_metrics(run_dir) if "eval/pass@1" in r][-1]["eval/pass@1"]


def main(args: Args) -> None:
    runs = {"grpo.py": ["grpo.py"], **{f"async_grpo.py K = {K}": ["async_grpo.py", "--max-staleness", str(K)] for K in args.staleness}}
    results = {label: [] for label in runs}
    for i in range(args.rounds):
        for label, argv in runs.items():
            with tempfile.TemporaryDirectory() as d:
                results[label].append(timed_run([*argv, *shlex.split(args.flags)], Path(d) / "run"))
            print(f"round {i} {label}: {results[label][-1][0]:.1f} s, pass@1 {results[label][-1][1]:.3f}", flush=True)
    flags = f' --flags="{args.flags}"' if args.flags else ""
    lines = [f"`python benchmarks/end_to_end.py --rounds {args.rounds} --staleness {' '.join(map(str, args.staleness))}{flags}`: "
             "each script with its defaults, one run at a time; median [min, max] over rounds.", "",
             "| script | wall s | wall vs grpo.py (round by round) | final eval/pass@1 |", "|---|---|---|---|"]
    for label, r in results.items():
        walls = [w for w, _ in r]
        ratio = [w / g for w, (g, _) in zip(walls, results["grpo.py"])]
        lines.append(f"| {label} | {statistics.median(walls):.1f} [{min(walls):.1f}, {max(walls):.1f}] | "
                     f"{statistics.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}] | "
                     f"{statistics.median(p for _, p in r):.3f} |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
