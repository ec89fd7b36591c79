"""Each script with no arguments, as a newcomer runs it: the README's first table.

    python repro/defaults.py                      # ~4 minutes on 2 CPU cores
    python repro/defaults.py --scripts grpo.py

Runs `python <script>` one after another (wall time and peak memory are each process's own), on the embedded
`reverse` job with every default (seed 0), and writes repro/results/defaults.md. The figures reproduce bit for bit
on one machine; another CPU rounds its matrix products differently, a draw flips within the first steps and the run
takes another course from there (the README says by how much).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import tyro
from runner import Job, evals, run_jobs, save_table

SCRIPTS = ["grpo.py", "ppo.py", "gapo.py", "is_grpo.py", "async_grpo.py"]


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    output_dir: str = "runs/repro_defaults"


def cpu_name() -> str:
    """The CPU's model name and the vector instructions torch's kernels pick from (they decide the rounding)."""
    info = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def main(args: Args) -> None:
    jobs = [Job(script.removesuffix(".py"), script, []) for script in args.scripts]
    runs = run_jobs(jobs, args.output_dir, workers=1)
    lines = [f"CPU: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
             "", "| command | base pass@1 | final pass@1 | final pass@8 | final greedy | wall time | peak memory |",
             "|---|---|---|---|---|---|---|"]
    for job in jobs:
        rows, run = evals(runs[job.name]["rows"]), runs[job.name]
        lines.append(f"| `python {job.script}` | {rows[0]['eval/pass@1']:.3f} | {rows[-1]['eval/pass@1']:.3f} | "
                     f"{rows[-1]['eval/pass@k']:.3f} | {rows[-1]['eval/greedy']:.3f} | {run['wall_s']:.0f} s | "
                     f"{run['peak_rss_mb']:.0f} MB |")
    save_table("defaults", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
