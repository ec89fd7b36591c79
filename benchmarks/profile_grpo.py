"""Where grpo.py's step time goes: a cProfile of the training loop on the default embedded job.

    python benchmarks/profile_grpo.py                # 30 steps, no evaluation in between; prints the top functions
    python benchmarks/profile_grpo.py --sort tottime

Start-up (imports, model loading) is left out: the profile covers main() after a warm run.
Per-step seconds (sampling, training) come from the run's own metrics.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import grpo  # noqa: E402
from common.logging import read_metrics  # noqa: E402


@dataclass
class Args:
    steps: int = 30
    sort: str = "cumulative"
    top: int = 35


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as d:
        def run(steps: int, name: str) -> None:
            grpo.main(grpo.Args(steps=steps, eval_every=0, eval_prompts=8, eval_samples=1, eval_k=1, save_every=100000,
                                device="cpu", output_dir=d, run_name=name))

        run(2, "warm")  # imports and first-call costs
        profile = cProfile.Profile()
        profile.enable()
        run(args.steps, "profiled")
        profile.disable()
        rows = [r for r in read_metrics(Path(d) / "profiled") if "time/train_s" in r][2:]
    print(f"per step (median over {len(rows)} steps): sampling {statistics.median(r['time/rollout_s'] for r in rows):.4f} s, "
          f"training {statistics.median(r['time/train_s'] for r in rows):.4f} s")
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main(tyro.cli(Args))
