"""Learning rate against staleness: the largest learning rate that stays stable at K = 0, 2 and 8.

    python repro/async_lr_staleness.py      # 21 runs (3 K x 7 learning rates), ~35 minutes on 2 CPU cores

async_grpo.py --mode emulated --correction none (the uncorrected "bypass", so the effect of
staleness is not masked by a correction), 100 steps, seed 0, on the embedded `reverse` job, for
K in {0, 2, 8} x lr from 5e-4 to 4e-3 in steps of sqrt(2) (at K = 0, 4e-3 and above collapse).
A run is stable if its held-out pass@1 never falls below the base model's (evaluated every 10 steps). The rule to
compare with (arXiv 2607.01083): the bias of a stale update grows like K x lr, so the largest
stable lr falls about as 1 / K (K = 2 -> 8 should divide it by about 4).
Writes repro/results/async_lr_staleness.{md,png}. repro/async_early_warning.py reuses these runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import Job, evals, pyplot, run_jobs, save_table

STEPS = 100


@dataclass
class Args:
    staleness: list[int] = field(default_factory=lambda: [0, 2, 8])
    lrs: list[float] = field(default_factory=lambda: [5e-4, 7e-4, 1e-3, 1.4e-3, 2e-3, 2.8e-3, 4e-3])
    seed: int = 0
    output_dir: str = "runs/repro_async_lr"
    workers: int = 2


def name(K: int, lr: float, seed: int) -> str:
    return f"K{K}_lr{lr:g}_s{seed}"


def job(K: int, lr: float, seed: int) -> Job:
    return Job(name(K, lr, seed), "async_grpo.py", ["--mode", "emulated", "--max-staleness", str(K), "--correction", "none",
                                                    "--lr", str(lr), "--steps", str(STEPS), "--seed", str(seed)])


def stable(rows: list[dict]) -> bool:
    p = [r["eval/pass@1"] for r in evals(rows)]
    return min(p[1:]) >= p[0]


def main(args: Args) -> None:
    runs = run_jobs([job(K, lr, args.seed) for K in args.staleness for lr in args.lrs], args.output_dir, args.workers)
    lines = ["final pass@1 after 100 steps (lowest pass@1 after step 0 in brackets); x = unstable (fell below the base model's "
             f"{evals(runs[name(args.staleness[0], args.lrs[0], args.seed)]['rows'])[0]['eval/pass@1']:.2f})", "",
             "| K | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | largest stable lr |",
             "|---" * (len(args.lrs) + 2) + "|"]
    largest = {}
    for K in args.staleness:
        cells = []
        for lr in args.lrs:
            rows = runs[name(K, lr, args.seed)]["rows"]
            p = [r["eval/pass@1"] for r in evals(rows)]
            cells.append(f"{p[-1]:.2f} ({min(p[1:]):.2f}){'' if stable(rows) else ' x'}")
        ok = [lr for lr in args.lrs if stable(runs[name(K, lr, args.seed)]["rows"])]
        largest[K] = max(ok) if ok else None
        lines.append(f"| {K} | " + " | ".join(cells) + (f" | {largest[K]:g} |" if ok else " | none |"))
    lines += ["", "| K | largest stable lr | K x lr | predicted by 1/K from the smallest K > 0 |", "|---|---|---|---|"]
    ref = next((K for K in args.staleness if K > 0 and largest[K]), None)
    for K in args.staleness:
        pred = f"{largest[ref] * ref / K:g}" if ref and K > 0 else "–"
        lines.append(f"| {K} | {largest[K]:g} | {K * largest[K]:g} | {pred} |" if largest[K] else f"| {K} | none | – | {pred} |")
    text = "\n".join(lines) + "\n"
    out = save_table("async_lr_staleness", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(args.staleness) + 1, figsize=(4 * (len(args.staleness) + 1), 3.6))
    cmap = plt.get_cmap("viridis")
    for ax, K in zip(axes, args.staleness):
        for i, lr in enumerate(args.lrs):
            e = evals(runs[name(K, lr, args.seed)]["rows"])
            ax.plot([x["step"] for x in e], [x["eval/pass@1"] for x in e], color=cmap(i / (len(args.lrs) - 1)), label=f"lr {lr:g}")
        ax.set(title=f"K = {K}", xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
    axes[0].legend(fontsize=7)
    for K, marker in zip(args.staleness, "os^D"):
        finals = [evals(runs[name(K, lr, args.seed)]["rows"])[-1]["eval/pass@1"] for lr in args.lrs]
        axes[-1].plot(args.lrs, finals, marker=marker, label=f"K = {K}")
    axes[-1].set(xscale="log", xlabel="learning rate", ylabel="final eval/pass@1", ylim=(0, 1))
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "async_lr_staleness.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
