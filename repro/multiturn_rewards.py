"""Partial-progress rewards and group-relative advantages, on the multi-turn chain task.

    python repro/multiturn_rewards.py        # 9 runs, two at a time: ~20 minutes on 2 CPU cores

Task chain-8 (8 model turns; the base model's sampled trajectories end right about 15 % of the time),
grpo.py with default flags (group-normalised advantages, A = (R - mean) / std within each group of
G = 8), three rewards of the same trajectories, 3 seeds, the same prompts, steps and lr:
  outcome   1 if the last running sum is right (paid at the last turn)            chain-8
  partial   1/8 for each turn whose running sum is right (credit per step)        chain-8-partial
  sum       outcome + partial                                                     chain-8-sum
Success is the same for all three: the last sum right (held-out pass@1 over sampled trajectories).
Reports success (held-out pass@1) along training, and the fraction of groups whose G rewards are all
equal (zero variance: no group-relative signal, A = 0 for the whole group).
Writes repro/results/multiturn_rewards.{md,png}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, mean_over_steps, mean_sd, pyplot, run_jobs, save_table, smooth

REWARDS = {"outcome": "", "partial": "-partial", "sum": "-sum"}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    turns: int = 8
    """chain length (model turns)"""
    workers: int = 2
    output_dir: str = "runs/repro_multiturn_rewards"
    flags: list[str] = field(default_factory=lambda: ["--steps", "150", "--eval-every", "10"])
    """flags given to every run"""


def main(args: Args) -> None:
    def name(reward: str, seed: int) -> str:
        return f"chain{args.turns}_{reward}_s{seed}"

    jobs = [Job(name(reward, seed), "grpo.py", ["--task", f"chain-{args.turns}{suffix}", *args.flags, "--seed", str(seed)])
            for reward, suffix in REWARDS.items() for seed in args.seeds]
    runs = run_jobs(jobs, args.output_dir, args.workers)
    rows_of = {reward: [runs[name(reward, s)]["rows"] for s in args.seeds] for reward in REWARDS}
    steps = [r["step"] for r in evals(rows_of["outcome"][0])]
    half = steps[len(steps) // 2]
    at = lambda r, step: next(x["eval/pass@1"] for x in evals(r) if x["step"] == step)  # noqa: E731
    first = lambda r, n: [x for x in r if "frac_reward_zero_std" in x][:n]  # noqa: E731
    early = [st for st in steps if 0 < st <= 30]
    lines = ["| reward | base success | " + " | ".join(f"step {st}" for st in early) + f" | step {half} | "
             f"final (step {steps[-1]}) | zero-variance groups, first 20 steps | zero-variance groups, all steps | runs |",
             "|---|---|" + "---|" * len(early) + "---|---|---|---|---|"]
    for reward, rows in rows_of.items():
        lines.append(f"| {reward} | {mean_sd([at(r, 0) for r in rows])} | "
                     + " | ".join(mean_sd([at(r, st) for r in rows]) for st in early) + " | "
                     f"{mean_sd([at(r, half) for r in rows])} | {mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([mean_over_steps(first(r, 20), 'frac_reward_zero_std') for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'frac_reward_zero_std') for r in rows])} | {len(rows)} |")
    text = "\n".join(lines) + "\n"
    out = save_table("multiturn_rewards", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for (reward, rows), color in zip(rows_of.items(), ["C0", "C1", "C2"]):
        for j, r in enumerate(rows):
            e = evals(r)
            axes[0].plot([p["step"] for p in e], [p["eval/pass@1"] for p in e], color=color, alpha=0.8,
                         label=reward if j == 0 else None)
            t = [x for x in r if "frac_reward_zero_std" in x]
            axes[1].plot([x["step"] for x in t], smooth([x["frac_reward_zero_std"] for x in t]), color=color, alpha=0.8,
                         label=reward if j == 0 else None)
    axes[0].set(xlabel="step", ylabel=f"success (held-out pass@1), chain-{args.turns}", ylim=(0, 1))
    axes[1].set(xlabel="step", ylabel="zero-variance groups (10-step mean)", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "multiturn_rewards.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
