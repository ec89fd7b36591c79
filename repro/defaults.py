"""Each script with no arguments, as a newcomer runs it: the README's first table.

    python repro/defaults.py                      # ~6 minutes on 2 CPU cores
    python repro/defaults.py --scripts grpo.py --seeds 0

Runs `python <script> --seed S` one after another (wall time and peak memory are each process's own), on the
embedded `reverse` job with every other default, for seeds 0, 1 and 2, and writes repro/results/defaults_<cpu>.md
(one table a CPU kind: intel_xeon, amd_epyc, ...): per script the mean and the range (min-max) over the seeds, and the
commit it was measured at; a script not rerun keeps its row. The figures reproduce bit for bit on one machine; another
CPU or another transformers release rounds its matrix products differently, a draw flips within the first steps
and the run takes another course from there: the range over seeds is what a user should expect to land in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import re

import torch
import transformers
import tyro
from runner import ROOT, Job, cpu_model, evals, git, run_jobs, save_table

SCRIPTS = ["grpo.py", "ppo.py", "gapo.py", "is_grpo.py", "async_grpo.py"]


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = "runs/repro_defaults"


def cpu_kind(name: str) -> str:
    """'intel_xeon', 'amd_epyc', ...: the file name part of a CPU's table (the first two words of its model name)."""
    words = re.sub(r"\(.*?\)|[^A-Za-z0-9 ]", " ", name).lower().split()
    return "_".join(words[:2]) or "unknown"


def spread(values: list[float], digits: int = 3) -> str:
    """'mean (min-max)' of the values; the value alone for one."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{sum(values) / len(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main(args: Args) -> None:
    jobs = {script: [Job(f"{script.removesuffix('.py')}_s{seed}", script, ["--seed", str(seed)]) for seed in args.seeds]
            for script in args.scripts}
    runs = run_jobs([job for per_seed in jobs.values() for job in per_seed], args.output_dir, workers=1)
    name, rows = f"defaults_{cpu_kind(cpu_model())}", {}
    table = ROOT / "repro" / "results" / f"{name}.md"
    if table.exists():  # the scripts not rerun keep their rows
        rows = {line.split("|")[1].strip(): line for line in table.read_text().splitlines() if line.startswith("| `python")}
    for script, per_seed in jobs.items():
        first = [evals(runs[job.name]["rows"])[0] for job in per_seed]
        last = [evals(runs[job.name]["rows"])[-1] for job in per_seed]
        rows[f"`python {script}`"] = (
            f"| `python {script}` | {spread([r['eval/pass@1'] for r in first])} | "
            f"{spread([r['eval/pass@1'] for r in last])} | {spread([r['eval/pass@k'] for r in last])} | "
            f"{spread([r['eval/greedy'] for r in last])} | {spread([runs[job.name]['wall_s'] for job in per_seed], 0)} s | "
            f"{spread([runs[job.name]['peak_rss_mb'] for job in per_seed], 0)} MB | {git('rev-parse', '--short', 'HEAD')} |")
    lines = [f"CPU: {cpu_model()}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{torch.get_num_threads()} threads; seeds {', '.join(map(str, args.seeds))}: mean (min-max)",
             "", "| command | base pass@1 | final pass@1 | final pass@8 | final greedy | wall time | peak memory | commit |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [rows[f"`python {script}`"] for script in SCRIPTS if f"`python {script}`" in rows]
    save_table(name, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
