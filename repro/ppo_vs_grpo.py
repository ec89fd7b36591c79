"""PPO against GRPO on the same embedded job, same model, same number of sampled completions.

    python repro/ppo_vs_grpo.py             # 6 runs one after another: ~20 minutes on 2 CPU cores

Both sample 256 completions per step (GRPO: 32 prompts x 8; PPO: 256 prompts x 1), each with its
default flags (GRPO 200 steps of one optimiser step; PPO 100 steps of 4 epochs x 4 minibatches: ppo.py's
defaults when this table was measured, before 2026-12-06, pinned here),
3 seeds each, one run at a time so that wall times and peak memory are the process's own.
Reports pass@1 against completions sampled and against wall time, peak resident memory of the
training process, and the parameters each method trains and holds. Writes
repro/results/ppo_vs_grpo.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import tyro
from runner import Job, evals, first_step_reaching, mean_over_steps, mean_sd, pyplot, run_jobs, save_table

ARMS = {
    "GRPO": ("grpo.py", []),
    "PPO (value head)": ("ppo.py", ["--steps", "100", "--ppo-epochs", "4"]),
}


def parameter_counts() -> dict[str, tuple[int, int]]:
    """(trainable, held in memory) parameters of each arm on the embedded model: the policy, the value
    head and the frozen reference (both methods keep one, beta > 0)."""
    from common.models import load_model, resolve_model

    policy = load_model(resolve_model("embedded", "reverse"))
    n, head = policy.num_parameters(), policy.config.hidden_size + 1
    return {"GRPO": (n, 2 * n), "PPO (value head)": (n + head, 2 * n + head)}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = "runs/repro_ppo_vs_grpo"
    threshold: float = 0.8


def main(args: Args) -> None:
    jobs = [Job(f"{ARMS[arm][0][:-3]}_s{seed}", ARMS[arm][0], [*ARMS[arm][1], "--seed", str(seed)])
            for arm in ARMS for seed in args.seeds]
    runs = run_jobs(jobs, args.output_dir, workers=1)
    counts = parameter_counts()
    per_step = 256
    lines = [f"| method | base pass@1 | final pass@1 | final pass@8 | completions to pass@1 {args.threshold} | "
             f"seconds to {args.threshold} | wall time (s) | peak memory (MB) | trainable / held parameters | "
             "std of step-to-step train-reward change |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows_of = {}
    for arm, (script, _) in ARMS.items():
        names = [f"{script[:-3]}_s{seed}" for seed in args.seeds]
        rows = [runs[n]["rows"] for n in names]
        rows_of[arm] = (rows, [runs[n] for n in names])
        reach = [first_step_reaching(r, "eval/pass@1", args.threshold) for r in rows]
        seconds = [time_at(r, s) for r, s in zip(rows, reach) if s is not None]
        lines.append(
            f"| {arm} | {mean_sd([evals(r)[0]['eval/pass@1'] for r in rows])} | {mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
            f"{mean_sd([evals(r)[-1]['eval/pass@k'] for r in rows])} | {mean_sd([s * per_step for s in reach if s is not None], 'never')} | "
            f"{mean_sd(seconds, 'never')} | {mean_sd([runs[n]['wall_s'] for n in names])} | {mean_sd([runs[n]['peak_rss_mb'] for n in names])} | "
            f"{counts[arm][0]:,} / {counts[arm][1]:,} | {mean_sd([update_noise(r) for r in rows])} |")
    lines += ["", "Diagnostics averaged over steps and seeds:", "", "| method | policy/clip_frac (low + high) | policy/approx_kl | "
              "frac_reward_zero_std | value/explained_variance |", "|---|---|---|---|---|"]
    for arm, (rows, _) in rows_of.items():
        clip = [mean_over_steps(r, "policy/clip_frac_low") + mean_over_steps(r, "policy/clip_frac_high") for r in rows]
        lines.append(f"| {arm} | {mean_sd(clip)} | {mean_sd([mean_over_steps(r, 'policy/approx_kl') for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'frac_reward_zero_std') for r in rows])} | "
                     f"{mean_sd([mean_over_steps(r, 'value/explained_variance') for r in rows])} |")
    text = "\n".join(lines) + "\n"
    out = save_table("ppo_vs_grpo", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for (arm, (rows, _)), color in zip(rows_of.items(), ["C0", "C3"]):
        for j, r in enumerate(rows):
            e = evals(r)
            label = arm if j == 0 else None
            axes[0].plot([x["step"] * per_step for x in e], [x["eval/pass@1"] for x in e], color=color, label=label, alpha=0.8)
            axes[1].plot([time_at(r, x["step"]) for x in e], [x["eval/pass@1"] for x in e], color=color, label=label, alpha=0.8)
    axes[0].set(xlabel="completions sampled", ylabel="eval/pass@1", ylim=(0, 1))
    axes[1].set(xlabel="seconds of rollout + training (eval excluded)", ylabel="eval/pass@1", ylim=(0, 1))
    for ax in axes:
        ax.axhline(args.threshold, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppo_vs_grpo.png", dpi=110)


def time_at(rows: list[dict], step: int) -> float:
    """Seconds of rollout and training up to the end of `step` (evaluation time excluded)."""
    return sum(r["time/rollout_s"] + r["time/train_s"] for r in rows if 0 < r["step"] <= step)


def update_noise(rows: list[dict]) -> float:
    """Step-to-step spread of the training reward: the std of its first differences."""
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return statistics.stdev(b - a for a, b in zip(rewards, rewards[1:]))


if __name__ == "__main__":
    main(tyro.cli(Args))
