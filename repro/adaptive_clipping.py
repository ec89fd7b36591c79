"""Adaptive clipping: GAPO against GRPO with the same fixed eps_low, on a hard embedded task.

    python repro/adaptive_clipping.py       # 9 runs, two at a time: ~15 minutes on 2 CPU cores

Task `reverse-long` (4-6 digits; the base model samples the right answer about 8 % of the time),
--num-iterations 2 so that clipping binds, the same prompts, G, steps and learning rate (1e-3:
the hard task needs the larger step) for every arm, 3 seeds:
  GRPO             std-normalised advantages, eps_low = eps_high = 0.2 (token ratios)
  GRPO, no std     the same without the std division: isolates GAPO's clip bound
  GAPO (token)     no std division, eps_low 0.2, eps_high(c) from 0.2 (c = k) to 0.28 (c = 1)
Reports pass@1 and pass@8 at equal sampled completions and GAPO's clip fraction by c.
Writes repro/results/adaptive_clipping.{md,png}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, mean_over_steps, mean_sd, pyplot, run_jobs, save_table, smooth

ARMS = {
    "GRPO": ("grpo.py", ["--eps-low", "0.2", "--eps-high", "0.2"]),
    "GRPO, no std": ("grpo.py", ["--eps-low", "0.2", "--eps-high", "0.2", "--scale-rewards", "none"]),
    "GAPO (token)": ("gapo.py", ["--ratio-level", "token", "--eps-low", "0.2", "--eps-high-max", "0.28"]),
    "GAPO (sequence)": ("gapo.py", ["--ratio-level", "sequence"]),
}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    arms: list[str] = field(default_factory=lambda: list(ARMS)[:3])
    """which arms to run (names as in ARMS)"""
    workers: int = 2
    output_dir: str = "runs/repro_adaptive_clipping"
    flags: list[str] = field(default_factory=lambda: ["--task", "reverse-long", "--num-iterations", "2", "--steps", "200",
                                                      "--lr", "1e-3", "--eval-every", "20"])
    """flags given to every run"""


def main(args: Args) -> None:
    def name(i: int, seed: int) -> str:
        return f"{ARMS[args.arms[i]][0][:-3]}{i}_s{seed}"

    jobs = [Job(name(i, seed), ARMS[arm][0], [*ARMS[arm][1], *args.flags, "--seed", str(seed)])
            for i, arm in enumerate(args.arms) for seed in args.seeds]
    runs = run_jobs(jobs, args.output_dir, args.workers)
    completions_per_step = 32 * 8
    rows_of = {arm: [runs[name(i, s)]["rows"] for s in args.seeds] for i, arm in enumerate(args.arms)}
    steps = [r["step"] for r in evals(next(iter(rows_of.values()))[0])]
    half = steps[len(steps) // 2]
    lines = [f"| method | base pass@1 | pass@1 at {half * completions_per_step} completions | final pass@1 "
             f"({steps[-1] * completions_per_step} completions) | final pass@8 | mean clip fraction | runs |",
             "|---|---|---|---|---|---|---|"]
    for arm, rows in rows_of.items():
        at = lambda r, step, key: next(x[key] for x in evals(r) if x["step"] == step)  # noqa: E731
        clip = [mean_over_steps(r, "policy/clip_frac_low") + mean_over_steps(r, "policy/clip_frac_high") for r in rows]
        lines.append(f"| {arm} | {mean_sd([at(r, 0, 'eval/pass@1') for r in rows])} | "
                     f"{mean_sd([at(r, half, 'eval/pass@1') for r in rows])} | {mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])} | "
                     f"{mean_sd([evals(r)[-1]['eval/pass@k'] for r in rows])} | {mean_sd(clip)} | {len(rows)} |")
    gapo_arms = [a for a in rows_of if a.startswith("GAPO")]
    for arm in gapo_arms:
        lines += ["", f"{arm}: clip fraction and mean |ratio - 1| by c (correct completions in the group, k = 8), "
                      "averaged over steps and seeds:", "", "| c | clip fraction | mean abs(ratio - 1) |", "|---|---|---|"]
        for c in range(9):
            fracs = [mean_over_steps(r, f"clip/frac_c{c}") for r in rows_of[arm]]
            devs = [mean_over_steps(r, f"clip/ratio_dev_c{c}") for r in rows_of[arm]]
            if all(f == f for f in fracs):  # this c occurred in every run (nan otherwise)
                lines.append(f"| {c} | {mean_sd(fracs)} | {mean_sd(devs)} |")
    text = "\n".join(lines) + "\n"
    out = save_table("adaptive_clipping", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for (arm, rows), color in zip(rows_of.items(), ["C0", "C1", "C2", "C3"]):
        for j, r in enumerate(rows):
            e = evals(r)
            x = [p["step"] * completions_per_step for p in e]
            axes[0].plot(x, [p["eval/pass@1"] for p in e], color=color, label=arm if j == 0 else None, alpha=0.8)
            axes[1].plot(x, [p["eval/pass@k"] for p in e], color=color, label=arm if j == 0 else None, alpha=0.8)
    axes[0].set(xlabel="completions sampled", ylabel="eval/pass@1", ylim=(0, 1))
    axes[1].set(xlabel="completions sampled", ylabel="eval/pass@8", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    if gapo_arms:
        r = rows_of[gapo_arms[0]][0]
        for c in range(1, 9):
            t = [x for x in r if f"clip/frac_c{c}" in x]
            if len(t) > 10:
                axes[2].plot([x["step"] for x in t], smooth([x[f"clip/frac_c{c}"] for x in t]), label=f"c = {c}")
        axes[2].set(xlabel="step", ylabel="clip fraction (10-step mean)", title=f"{gapo_arms[0]}, seed {args.seeds[0]}")
        axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "adaptive_clipping.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
