"""The staleness trade-off: how much does learning lose, and how much faster does it run, at staleness K?

    python repro/async_tradeoff.py          # 39 learning runs, two at a time, then 18 timing runs alone: ~60 minutes on 2 CPU cores

Learning (reproducible): async_grpo.py --mode emulated, so batch t is sampled from exactly version
t - 1 - K, for K in {0, 1, 2, 4, 8} x --correction in {none, tis, decoupled} x 3 seeds, every other
flag at its default (the embedded `reverse` job, lr 5e-4, 200 steps). At K = 0 the three corrections
are the same objective (w = 1 and mu = pi_old; the test suite checks each equals grpo.py bit for bit),
so K = 0 is run once per seed and shared by the three rows.

Speed (real threads): async_grpo.py --mode threaded for each K (tis, seed 0, 60 steps, no evaluation
in between) against grpo.py on the same settings, one run at a time so that nothing else competes for
the 2 cores, in 3 rounds (grpo.py, K = 0, 1, 2, 4, 8, then again): the machine's speed drifts, so each
K is compared with the grpo.py run of its own round and the median over rounds is reported.
samples/s = completions / (learner wait + train time), steps 6-60.
"Seconds to 0.8" = emulated steps to pass@1 0.8 x the threaded seconds per step at that K.

A run "collapses" if its final pass@1 is below half its best, or below the base model's.
Writes repro/results/async_tradeoff.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import tyro
from runner import Job, collapsed, evals, first_step_reaching, mean_over_steps, mean_sd, pyplot, run_jobs, save_table

CORRECTIONS = ["none", "tis", "decoupled"]


@dataclass
class Args:
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = "runs/repro_async_tradeoff"
    threshold: float = 0.8
    timing_steps: int = 60
    timing_rounds: int = 3
    workers: int = 2
    """learning runs at a time (each gets 2 / workers threads); the timing runs always run alone"""


def learning_name(K: int, correction: str, seed: int) -> str:
    return f"emu_K{K}_{'all' if K == 0 else correction}_s{seed}"


def main(args: Args) -> None:
    jobs = {learning_name(K, c, s): ["--mode", "emulated", "--max-staleness", str(K), "--correction", c, "--seed", str(s)]
            for K in args.staleness for c in CORRECTIONS for s in args.seeds}
    runs = run_jobs([Job(name, "async_grpo.py", flags) for name, flags in jobs.items()], args.output_dir, args.workers)
    timing_flags = ["--steps", str(args.timing_steps), "--eval-every", "0", "--eval-prompts", "16", "--save-every", "1000"]
    timing_jobs = []
    for r in range(args.timing_rounds):
        timing_jobs.append(Job(f"time_grpo_r{r}", "grpo.py", timing_flags))
        timing_jobs += [Job(f"time_K{K}_r{r}", "async_grpo.py", [*timing_flags, "--max-staleness", str(K)]) for K in args.staleness]
    timed = run_jobs(timing_jobs, args.output_dir, workers=1)

    def step_seconds(name: str) -> float:  # per trained step, the first 5 (warm-up) left out
        rows = [r for r in timed[name]["rows"] if r["step"] > 5 and "time/train_s" in r]
        wait = "time/rollout_s" if name.startswith("time_grpo") else "time/learner_wait_s"
        return statistics.mean(r[wait] + r["time/train_s"] for r in rows)

    rounds = range(args.timing_rounds)
    speed = {K: statistics.median(256 / step_seconds(f"time_K{K}_r{r}") for r in rounds) for K in args.staleness}
    ratio = {K: statistics.median(step_seconds(f"time_grpo_r{r}") / step_seconds(f"time_K{K}_r{r}") for r in rounds)
             for K in args.staleness}
    per_step = 256
    grpo_sps = statistics.median(per_step / step_seconds(f"time_grpo_r{r}") for r in rounds)
    lines = [f"grpo.py on the same machine and settings: {grpo_sps:.0f} samples/s (median of {args.timing_rounds} runs).", "",
             f"| K | correction | final pass@1 | steps to pass@1 {args.threshold} | seconds to {args.threshold} (threaded) | "
             "samples/s (threaded, median) | vs grpo.py (round by round, median) | threaded staleness (mean) | collapsed runs | "
             "behaviour KL | ESS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for K in args.staleness:
        sec = per_step / speed[K]
        trows = [r for n in rounds for r in timed[f"time_K{K}_r{n}"]["rows"] if "offpolicy/staleness_mean" in r]
        for c in CORRECTIONS if K > 0 else ["(any)"]:
            rows = [runs[learning_name(K, c if K else "none", s)]["rows"] for s in args.seeds]
            reach = [first_step_reaching(r, "eval/pass@1", args.threshold) for r in rows]
            finals = [evals(r)[-1]["eval/pass@1"] for r in rows]
            table[(K, c)] = (finals, reach, rows)
            lines.append(
                f"| {K} | {c} | {mean_sd(finals)} | {mean_sd(reach, 'never')} ({sum(s is not None for s in reach)}/{len(reach)}) | "
                f"{mean_sd([s * sec for s in reach if s is not None], 'never')} | {speed[K]:.0f} | {ratio[K]:.2f}x | "
                f"{mean_over_steps(trows, 'offpolicy/staleness_mean'):.2f} | {sum(map(collapsed, rows))}/{len(rows)} | "
                f"{mean_sd([mean_over_steps(r, 'offpolicy/behaviour_kl') for r in rows])} | "
                f"{mean_sd([mean_over_steps(r, 'offpolicy/ess') for r in rows])} |")
    text = "\n".join(lines) + "\n"
    out = save_table("async_tradeoff", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for c, color in zip(CORRECTIONS, ["C3", "C0", "C2"]):
        ks = args.staleness
        finals = [table[(K, c if K else "(any)")][0] for K in ks]
        axes[0].errorbar(ks, [statistics.mean(f) for f in finals], yerr=[statistics.stdev(f) if len(f) > 1 else 0 for f in finals],
                         color=color, marker="o", capsize=3, label=c)
        for j, rows in enumerate(table[(max(ks), c)][2]):
            e = evals(rows)
            axes[1].plot([x["step"] for x in e], [x["eval/pass@1"] for x in e], color=color, alpha=0.7,
                         label=f"{c}, K={max(ks)}" if j == 0 else None)
    for j, rows in enumerate(table[(0, "(any)")][2]):
        e = evals(rows)
        axes[1].plot([x["step"] for x in e], [x["eval/pass@1"] for x in e], color="k", alpha=0.7, label="K=0" if j == 0 else None)
    axes[0].set(xlabel="staleness K (emulated)", ylabel="final eval/pass@1 (3 seeds)", xscale="symlog", xticks=args.staleness)
    axes[0].set_xticklabels([str(k) for k in args.staleness])
    axes[1].set(xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
    axes[1].axhline(args.threshold, color="grey", lw=0.5)
    axes[2].bar([str(K) for K in args.staleness], [speed[K] for K in args.staleness], color="C0",
                label="async_grpo.py (threaded)")
    axes[2].axhline(grpo_sps, color="k", ls="--", label="grpo.py")
    axes[2].set(xlabel="--max-staleness K", ylabel="samples/s (learner wait + train)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "async_tradeoff.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
