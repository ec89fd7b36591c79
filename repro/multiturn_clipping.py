"""Clipping against trajectory length, on the multi-turn chain task.

    python repro/multiturn_clipping.py                    # 24 runs, two at a time: ~28 minutes on 2 CPU cores
    python repro/multiturn_clipping.py --regime strong    # larger updates, so that the clip binds: ~30 minutes

Task chain-N (running sum mod 10, one operand per model turn; outcome reward: 1 if the last sum is
right) at three lengths: short N = 2, medium N = 4, long N = 8 model turns (7, 17 and 37 tokens after
the prompt, of which 4, 8 and 16 are the model's). At each length, four clip settings, all with
several passes over each batch (so that the later passes can clip) and the same prompts, steps and lr:
  eps 0.1 / 0.2 / 0.3   grpo.py, token-level ratio, eps_low = eps_high = eps
  GAPO adaptive         gapo.py, token ratio, eps_low 0.2, eps_high(c) from 0.2 (c = k) to 0.28 (c = 1)
Two regimes (--regime): default (lr 5e-4, --num-iterations 2, 100 steps: the default lr) and strong
(lr 2e-3, --num-iterations 4, 60 steps: updates large enough for eps to bind). 2 seeds each.
Reports held-out success (pass@1 over sampled trajectories), the clip fraction (both
sides, all passes; mean over training steps) and the ratio spread (std of r over the step's model
tokens; median over steps, as a few steps where one token's probability jumps dominate a mean, and
the largest step); and both by turn (position in the trajectory) at the long length.
Writes repro/results/multiturn_clipping[_strong].{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

import tyro
from runner import Job, evals, mean_over_steps, mean_sd, over_steps, pyplot, run_jobs, save_table

LENGTHS = {"short": 2, "medium": 4, "long": 8}
ARMS = {
    "eps 0.1": ("grpo.py", ["--eps-low", "0.1", "--eps-high", "0.1"]),
    "eps 0.2": ("grpo.py", ["--eps-low", "0.2", "--eps-high", "0.2"]),
    "eps 0.3": ("grpo.py", ["--eps-low", "0.3", "--eps-high", "0.3"]),
    "GAPO adaptive": ("gapo.py", ["--ratio-level", "token", "--eps-low", "0.2", "--eps-high-max", "0.28"]),
}
REGIMES = {
    "default": ["--num-iterations", "2", "--steps", "100", "--eval-every", "25"],
    "strong": ["--num-iterations", "4", "--steps", "60", "--lr", "2e-3", "--eval-every", "20"],
}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    lengths: list[str] = field(default_factory=lambda: list(LENGTHS))
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    regime: Literal["default", "strong"] = "default"
    """flags given to every run: REGIMES[regime]"""
    workers: int = 2


def clip_frac(row: dict) -> float:
    return row["policy/clip_frac_low"] + row["policy/clip_frac_high"]


def main(args: Args) -> None:
    def name(length: str, arm: str, seed: int) -> str:
        return f"{length}_{list(ARMS).index(arm)}_s{seed}"

    suffix = "" if args.regime == "default" else f"_{args.regime}"
    jobs = [Job(name(length, arm, seed), ARMS[arm][0],
                [*ARMS[arm][1], "--task", f"chain-{LENGTHS[length]}", *REGIMES[args.regime], "--seed", str(seed)])
            for length in args.lengths for arm in args.arms for seed in args.seeds]
    runs = run_jobs(jobs, f"runs/repro_multiturn_clipping{suffix}", args.workers)
    rows_of = {(length, arm): [runs[name(length, arm, s)]["rows"] for s in args.seeds]
               for length in args.lengths for arm in args.arms}
    with_clip = lambda rows: [{**r, "clip": clip_frac(r)} for r in rows if "policy/clip_frac_low" in r]  # noqa: E731
    lines = [f"Regime `{args.regime}`: `{' '.join(REGIMES[args.regime])}`, seeds {args.seeds}.", "",
             "| length (model turns) | clip | base success | final success | clip fraction | ratio spread: median step | "
             "ratio spread: largest step | runs |", "|---|---|---|---|---|---|---|---|"]
    for (length, arm), rows in rows_of.items():
        lines.append(f"| {length} ({LENGTHS[length]}) | {arm} | {mean_sd([evals(r)[0]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([mean_over_steps(with_clip(r), 'clip') for r in rows], missing='–')} | "
                     f"{mean_sd([over_steps(r, 'turns/ratio_std', statistics.median) for r in rows])} | "
                     f"{mean_sd([over_steps(r, 'turns/ratio_std', max) for r in rows])} | {len(rows)} |")
    longest = args.lengths[-1]
    turns = range(1, LENGTHS[longest] + 1)
    lines += ["", f"By position, {longest} ({LENGTHS[longest]} turns): clip fraction (mean over steps) / ratio spread "
                  "(median over steps) at model turn k, averaged over seeds:", "",
              "| clip | " + " | ".join(f"turn {k}" for k in turns) + " |", "|---|" + "---|" * len(turns)]
    for arm in args.arms:
        rows = rows_of[(longest, arm)]
        cells = [f"{sum(mean_over_steps(r, f'turns/clip_frac_t{k}') for r in rows) / len(rows):.4f} / "
                 f"{sum(over_steps(r, f'turns/ratio_std_t{k}', statistics.median) for r in rows) / len(rows):.4f}" for k in turns]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    out = save_table(f"multiturn_clipping{suffix}", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    x = range(len(args.lengths))
    for arm, color in zip(args.arms, ["C0", "C1", "C2", "C3"]):
        final = [sum(evals(r)[-1]["eval/pass@1"] for r in rows_of[(ln, arm)]) / len(args.seeds) for ln in args.lengths]
        clip = [sum(mean_over_steps(with_clip(r), "clip") for r in rows_of[(ln, arm)]) / len(args.seeds) for ln in args.lengths]
        axes[0].plot(x, final, "o-", color=color, label=arm)
        axes[1].plot(x, clip, "o-", color=color, label=arm)
        rows = rows_of[(longest, arm)]
        axes[2].plot(list(turns), [sum(mean_over_steps(r, f"turns/clip_frac_t{k}") for r in rows) / len(rows) for k in turns],
                     "o-", color=color, label=arm)
    labels = [f"{ln} ({LENGTHS[ln]})" for ln in args.lengths]
    axes[0].set(xticks=list(x), xticklabels=labels, xlabel="trajectory length (model turns)", ylabel="final success (pass@1)",
                ylim=(0, 1))
    axes[1].set(xticks=list(x), xticklabels=labels, xlabel="trajectory length (model turns)",
                ylabel="clip fraction (mean over steps)")
    axes[2].set(xlabel=f"model turn ({longest})", ylabel="clip fraction at that turn")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"multiturn_clipping{suffix}.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
