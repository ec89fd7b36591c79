"""Reproduce the README's GRPO results on the embedded jobs: default flags, 3 seeds, both tasks.

    python repro/grpo_embedded.py                 # ~10 minutes on 2 CPU cores
    python repro/grpo_embedded.py --seeds 0 --tasks reverse

Runs `python grpo.py --task T --seed S` one after another (so that wall times are not shared),
then writes repro/results/grpo_embedded.md (table and curve) and repro/results/grpo_embedded.png.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, pyplot, run_jobs, save_table


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    tasks: list[str] = field(default_factory=lambda: ["reverse", "add"])
    output_dir: str = "runs/repro_grpo_embedded"


def main(args: Args) -> None:
    jobs = [Job(f"{task}_s{seed}", "grpo.py", ["--task", task, "--seed", str(seed)]) for task in args.tasks for seed in args.seeds]
    runs = run_jobs(jobs, args.output_dir, workers=1)
    lines = ["| task | seed | base pass@1 | final pass@1 | final pass@8 | final greedy | wall time (s) |",
             "|---|---|---|---|---|---|---|"]
    for job in jobs:
        rows = evals(runs[job.name]["rows"])
        base, final = rows[0], rows[-1]
        task, seed = job.name.rsplit("_s", 1)
        lines.append(f"| {task} | {seed} | {base['eval/pass@1']:.3f} | {final['eval/pass@1']:.3f} | "
                     f"{final['eval/pass@k']:.3f} | {final['eval/greedy']:.3f} | {runs[job.name]['wall_s']:.0f} |")
    lines += ["", f"eval/pass@1 by step (seed {args.seeds[0]}):", ""]
    for task in args.tasks:
        curve = evals(runs[f"{task}_s{args.seeds[0]}"]["rows"])
        lines.append(f"- {task}: " + ", ".join(f"{r['step']}: {r['eval/pass@1']:.2f}" for r in curve))
    text = "\n".join(lines) + "\n"
    out = save_table("grpo_embedded", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(args.tasks), figsize=(5 * len(args.tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], args.tasks):
        for seed in args.seeds:
            curve = evals(runs[f"{task}_s{seed}"]["rows"])
            ax.plot([r["step"] for r in curve], [r["eval/pass@1"] for r in curve], label=f"seed {seed}")
        ax.set(title=f"grpo.py --task {task}", xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grpo_embedded.png", dpi=120)


if __name__ == "__main__":
    main(tyro.cli(Args))
