"""Normalisation: GRPO (std-normalised), Dr. GRPO (unnormalised) and IS-GRPO on the embedded job.

    python repro/normalisation.py          # 9 runs, two at a time: ~10 minutes on 2 CPU cores

All three use the same pool of 512 training prompts (--train-size 512), so that a prompt is seen
about 12 times in 200 steps and IS-GRPO's sigma estimates mean something. Reports, over 3 seeds:
steps and sampled completions to reach eval pass@1 0.8, final pass@1, the average within-prompt
reward std over training, and the share of all-equal groups. Writes
repro/results/normalisation.{md,png}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, first_step_reaching, mean_over_steps, mean_sd, pyplot, run_jobs, save_table, smooth

ARMS = {
    "GRPO (group std)": ("grpo.py", []),
    "Dr. GRPO (no std)": ("grpo.py", ["--scale-rewards", "none"]),
    "IS-GRPO (q ∝ sigma)": ("is_grpo.py", []),
    "IS-GRPO ablation (uniform, sigma weights)": ("is_grpo.py", ["--prompt-weighting"]),
}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    arms: list[str] = field(default_factory=lambda: list(ARMS)[:3])
    """which arms to run (names as in ARMS)"""
    threshold: float = 0.8
    workers: int = 2
    output_dir: str = "runs/repro_normalisation"
    flags: list[str] = field(default_factory=lambda: ["--train-size", "512", "--steps", "200"])
    """flags given to every run"""


def main(args: Args) -> None:
    jobs = [Job(f"{ARMS[arm][0][:-3]}{i}_s{seed}", ARMS[arm][0], [*ARMS[arm][1], *args.flags, "--seed", str(seed)])
            for i, arm in enumerate(args.arms) for seed in args.seeds]
    runs = run_jobs(jobs, args.output_dir, args.workers)
    completions_per_step = 32 * 8
    lines = [f"| method | steps to pass@1 {args.threshold} | completions to {args.threshold} | final pass@1 | "
             "mean within-prompt reward std | mean frac_reward_zero_std | runs reaching |", "|---|---|---|---|---|---|---|"]
    curves = {}
    for i, arm in enumerate(args.arms):
        names = [f"{ARMS[arm][0][:-3]}{i}_s{seed}" for seed in args.seeds]
        rows = [runs[n]["rows"] for n in names]
        reach = [first_step_reaching(r, "eval/pass@1", args.threshold) for r in rows]
        reached = [s for s in reach if s is not None]
        lines.append(f"| {arm} | {mean_sd(reached, 'never')} | {mean_sd([s * completions_per_step for s in reached], 'never')} | "
                     f"{mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'reward/group_std_mean') for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'frac_reward_zero_std') for r in rows])} | {len(reached)}/{len(rows)} |")
        curves[arm] = rows
    text = "\n".join(lines) + "\n"
    out = save_table("normalisation", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for (arm, rows), color in zip(curves.items(), ["C0", "C1", "C2", "C3"]):
        for j, r in enumerate(rows):
            label = arm if j == 0 else None
            e = evals(r)
            axes[0].plot([x["step"] * completions_per_step for x in e], [x["eval/pass@1"] for x in e], color=color, label=label, alpha=0.8)
            t = [x for x in r if "reward/group_std_mean" in x]
            axes[1].plot([x["step"] for x in t], smooth([x["reward/group_std_mean"] for x in t]), color=color, label=label, alpha=0.8)
            axes[2].plot([x["step"] for x in t], smooth([x["frac_reward_zero_std"] for x in t]), color=color, label=label, alpha=0.8)
    axes[0].set(xlabel="completions sampled", ylabel="eval/pass@1", ylim=(0, 1))
    axes[0].axhline(args.threshold, color="grey", lw=0.5)
    axes[1].set(xlabel="step", ylabel="within-prompt reward std (10-step mean)")
    axes[2].set(xlabel="step", ylabel="frac_reward_zero_std (10-step mean)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "normalisation.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
