"""DAPO's dynamic sampling against plain GRPO on the embedded job.

    python repro/dynamic_sampling.py          # 6 runs, one at a time: ~10 minutes on 2 CPU cores

Both are grpo.py with default flags (32 prompts x 8 completions a step, 200 steps); dynamic sampling
(--dynamic-sampling, at most 4 draws a step) replaces every group whose 8 rewards are all equal with a
fresh prompt's group. Reports, over 3 seeds: steps, sampled completions and seconds of sampling +
training (evaluation excluded) to reach held-out pass@1 0.8, final pass@1, and the extra sampling it
took (draws per step, groups dropped). Runs one at a time so that the seconds are comparable. Writes
repro/results/dynamic_sampling.{md,png}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, first_step_reaching, mean_over_steps, mean_sd, pyplot, run_jobs, save_table

ARMS = {"GRPO": [], "GRPO + dynamic sampling (DAPO)": ["--dynamic-sampling"]}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    threshold: float = 0.8
    output_dir: str = "runs/repro_dynamic_sampling"


def seconds_to(rows: list[dict], step: int | None) -> float | None:
    """Seconds of sampling + training up to the end of `step` (evaluation excluded)."""
    if step is None:
        return None
    return sum(r["time/rollout_s"] + r["time/train_s"] for r in rows if 0 < r["step"] <= step)


def completions_to(rows: list[dict], step: int | None) -> float | None:
    """Completions sampled up to the end of `step`, the dropped groups' included (8 completions a group)."""
    if step is None:
        return None
    return sum(256 + 8 * r.get("sampling/dropped_groups", 0.0) for r in rows if 0 < r["step"] <= step)


def main(args: Args) -> None:
    jobs = {arm: [Job(f"arm{i}_s{seed}", "grpo.py", [*flags, "--seed", str(seed)]) for seed in args.seeds]
            for i, (arm, flags) in enumerate(ARMS.items())}
    runs = run_jobs([j for js in jobs.values() for j in js], args.output_dir, workers=1)
    lines = [f"| method | steps to pass@1 {args.threshold} | completions sampled to {args.threshold} | seconds to "
             f"{args.threshold} | final pass@1 | draws per step | groups dropped per step | frac_reward_zero_std | "
             "runs reaching |", "|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for arm, arm_jobs in jobs.items():
        rows = [runs[j.name]["rows"] for j in arm_jobs]
        reach = [first_step_reaching(r, "eval/pass@1", args.threshold) for r in rows]
        lines.append(f"| {arm} | {mean_sd(reach, 'never')} | {mean_sd([completions_to(r, s) for r, s in zip(rows, reach)], 'never')} | "
                     f"{mean_sd([seconds_to(r, s) for r, s in zip(rows, reach)], 'never')} | "
                     f"{mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'sampling/rounds') for r in rows]) if 'dynamic' in arm else '1'} | "
                     f"{mean_sd([mean_over_steps(r, 'sampling/dropped_groups') for r in rows]) if 'dynamic' in arm else '0'} | "
                     f"{mean_sd([mean_over_steps(r, 'frac_reward_zero_std') for r in rows])} | "
                     f"{sum(s is not None for s in reach)}/{len(rows)} |")
        curves[arm] = rows
    out = save_table("dynamic_sampling", "\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for (arm, rows), color in zip(curves.items(), ["C0", "C3"]):
        for j, r in enumerate(rows):
            e = evals(r)
            label = arm if j == 0 else None
            axes[0].plot([x["step"] for x in e], [x["eval/pass@1"] for x in e], color=color, alpha=0.8, label=label)
            axes[1].plot([seconds_to(r, x["step"]) for x in e], [x["eval/pass@1"] for x in e], color=color, alpha=0.8, label=label)
    axes[0].set(xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
    axes[1].set(xlabel="seconds of sampling + training", ylabel="eval/pass@1", ylim=(0, 1))
    for ax in axes:
        ax.axhline(args.threshold, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dynamic_sampling.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
