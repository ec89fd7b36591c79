"""Every off-policy correction async_grpo.py has, side by side under a controlled lag.

    python repro/async_corrections.py       # 57 runs, two at a time: ~30 minutes on 2 CPU cores

async_grpo.py --mode emulated (batch t sampled from exactly version t - 1 - K) on the embedded `reverse` job with
every other flag at its default (lr 5e-4, 200 steps), K in {4, 8} x --correction in {none, tis, decoupled, m2po,
icepop, seq-mask, opsm, cispo} x 3 seeds, each correction's thresholds at their defaults; seq-mask also at
--seq-mask-cap 1.05 (its default, verl's 1.001, is sized for the sampler/trainer mismatch). K = 0 (grpo.py: every
correction is the same objective there) once per seed as the reference.

Per arm: final held-out pass@1, steps to pass@1 0.8 and seconds to it (steps x the arm's own mean seconds per
step, sampling and training, measured two runs at a time: compare arms with each other, not with other tables),
and what the correction did, averaged over steps: the share of tokens it dropped (offpolicy/mask_frac), of
sequences it dropped whole (mask_seq_frac), of tokens whose weight it truncated or clipped (cap_frac), and of
tokens the PPO clip cut (clip_frac_low + high). Writes repro/results/async_corrections.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import tyro
from runner import Job, collapsed, evals, first_step_reaching, mean_over_steps, mean_sd, pyplot, run_jobs, save_table

CORRECTIONS = {"none": [], "tis": [], "decoupled": [], "m2po": [], "icepop": [], "seq-mask": [], "opsm": [], "cispo": [],
               "seq-mask C=1.05": ["--seq-mask-cap", "1.05"]}


@dataclass
class Args:
    staleness: list[int] = field(default_factory=lambda: [4, 8])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    corrections: list[str] = field(default_factory=lambda: list(CORRECTIONS))
    output_dir: str = "runs/repro_async_corrections"
    threshold: float = 0.8
    workers: int = 2
    """runs at a time (each gets 2 / workers threads)"""


def name(K: int, correction: str, seed: int) -> str:
    return f"K{K}_{correction.replace(' ', '_').replace('=', '')}_s{seed}"


def job(K: int, correction: str, seed: int) -> Job:
    flags = ["--mode", "emulated", "--max-staleness", str(K), "--correction", correction.split(" ")[0],
             *CORRECTIONS[correction], "--seed", str(seed)]
    return Job(name(K, correction, seed), "async_grpo.py", flags)


def seconds_per_step(rows: list[dict]) -> float:
    trained = [r for r in rows if "time/train_s" in r and r["step"] > 1]
    return statistics.mean(r["time/learner_wait_s"] + r["time/train_s"] for r in trained)


def main(args: Args) -> None:
    arms = [(0, "none")] + [(K, c) for K in args.staleness for c in args.corrections]
    runs = run_jobs([job(K, c, s) for K, c in arms for s in args.seeds], args.output_dir, args.workers)
    lines = [f"| K | correction | final pass@1 | steps to {args.threshold} | seconds to {args.threshold} | s / step | "
             "tokens dropped | sequences dropped | weights capped | PPO clip | behaviour KL | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for K, c in arms:
        rows = [runs[name(K, c, s)]["rows"] for s in args.seeds]
        finals = [evals(r)[-1]["eval/pass@1"] for r in rows]
        reach = [first_step_reaching(r, "eval/pass@1", args.threshold) for r in rows]
        seconds = [step * seconds_per_step(r) for step, r in zip(reach, rows) if step is not None]
        table[(K, c)] = (finals, rows)

        def over(key):
            return mean_sd([mean_over_steps(r, key) for r in rows])

        clip = mean_sd([mean_over_steps(r, "policy/clip_frac_low") + mean_over_steps(r, "policy/clip_frac_high") for r in rows])
        lines.append(f"| {K} | {'(grpo.py)' if K == 0 else c} | {mean_sd(finals)} | "
                     f"{mean_sd(reach, 'never')} ({sum(s is not None for s in reach)}/{len(reach)}) | {mean_sd(seconds, 'never')} | "
                     f"{mean_sd([seconds_per_step(r) for r in rows])} | {over('offpolicy/mask_frac')} | "
                     f"{over('offpolicy/mask_seq_frac')} | {over('offpolicy/cap_frac')} | {clip} | "
                     f"{over('offpolicy/behaviour_kl')} | {sum(map(collapsed, rows))}/{len(rows)} |")
    out = save_table("async_corrections", "\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 1 + len(args.staleness), figsize=(5 * (1 + len(args.staleness)), 4.2))
    reference = [statistics.mean(table[(0, "none")][0])]
    for i, c in enumerate(args.corrections):
        means = [statistics.mean(table[(K, c)][0]) for K in args.staleness]
        sds = [statistics.stdev(table[(K, c)][0]) if len(args.seeds) > 1 else 0 for K in args.staleness]
        axes[0].errorbar([K + 0.08 * (i - len(args.corrections) / 2) for K in args.staleness], means, yerr=sds, marker="o",
                         capsize=3, label=c, color=f"C{i}")
    axes[0].axhline(reference[0], color="k", ls="--", lw=1, label="K = 0 (grpo.py)")
    axes[0].set(xlabel="staleness K (emulated)", ylabel=f"final eval/pass@1 ({len(args.seeds)} seeds)", xticks=args.staleness)
    axes[0].legend(fontsize=7, ncol=2)
    for ax, K in zip(axes[1:], args.staleness):
        for i, c in enumerate(args.corrections):
            curves = [evals(r) for r in table[(K, c)][1]]
            steps = [x["step"] for x in curves[0]]
            ax.plot(steps, [statistics.mean(e[j]["eval/pass@1"] for e in curves) for j in range(len(steps))], color=f"C{i}",
                    label=c)
        e0 = [evals(r) for r in table[(0, "none")][1]]
        ax.plot([x["step"] for x in e0[0]], [statistics.mean(e[j]["eval/pass@1"] for e in e0) for j in range(len(e0[0]))],
                color="k", ls="--", label="K = 0")
        ax.axhline(args.threshold, color="grey", lw=0.5)
        ax.set(title=f"K = {K}: mean of {len(args.seeds)} seeds", xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(out / "async_corrections.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
