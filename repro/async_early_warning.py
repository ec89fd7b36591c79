"""Early warning: which diagnostics reveal stale rollouts before the reward collapses?

    python repro/async_early_warning.py     # 6 runs (plus those of async_lr_staleness.py it reuses), ~10 minutes

A setting that collapses: --max-staleness 8 (emulated) with a learning rate that is stable at K = 0
(async_lr_staleness.py measures which), against the same staleness at a learning rate that is
stable at K = 8, 3 seeds each, --correction none, 100 steps. Every diagnostic is logged every step.

Both arms see the same staleness schedule (batch t comes from version max(t - 1 - K, 0), so the
staleness ramps 0, 1, ..., K over the first K + 1 steps), so they are compared step for step from
step 2 on. Thresholds are set on the stable runs: for a diagnostic that rises before trouble, the
largest value (smoothed over 5 steps) any stable run logged; for ESS, which falls, the smallest. The
reward collapses at the first step at which the training reward, smoothed over 5 steps, is below
half of its best so far (once it has risen above the first step's). The lead of a diagnostic is the
collapse step minus the first step at which the diagnostic, smoothed the same way, crosses its
threshold. Writes repro/results/async_early_warning.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import tyro
from async_lr_staleness import job
from runner import evals, pyplot, run_jobs, save_table, smooth

WARM_UP = 1  # step 1 is on-policy in every run (version 0 trains on version 0): nothing to compare
# (metric, direction): +1 rises before trouble, -1 falls
DIAGNOSTICS = [
    ("offpolicy/behaviour_kl", +1),
    ("offpolicy/behaviour_ratio_max", +1),
    ("offpolicy/behaviour_ratio_std", +1),
    ("offpolicy/ess", -1),
    ("offpolicy/behaviour_ratio_p99", +1),  # issue 34's candidates: the tail of w,
    ("offpolicy/moved_frac", +1),  # the tokens whose probability moved by more than 2x,
    ("offpolicy/pos_above_1.2", +1),  # the positive-advantage tokens a clip against mu would stop
    ("policy/clip_frac", +1),  # low + high
    ("policy/entropy", +1),
    ("policy/grad_norm", +1),
    ("policy/kl_ref", +1),
]


@dataclass
class Args:
    staleness: int = 8
    collapse_lr: float = 2e-3
    """a learning rate that is stable at K = 0 (see repro/results/async_lr_staleness.md)"""
    stable_lr: float = 5e-4
    """a learning rate that is stable at this staleness"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = "runs/repro_async_lr"
    workers: int = 2


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in rows if "reward/mean" in r]
    if key == "policy/clip_frac":
        values = [r["policy/clip_frac_low"] + r["policy/clip_frac_high"] for r in rows]
    else:
        values = [r[key] for r in rows]
    return [r["step"] for r in rows], smooth(values, 5)


def collapse_step(rows: list[dict]) -> int | None:
    steps, reward = series(rows, "reward/mean")
    base, best = reward[0], float("-inf")
    for step, value in zip(steps, reward):
        best = max(best, value)
        if best > base and value < 0.5 * best:
            return step
    return None


def first_crossing(rows: list[dict], key: str, direction: int, threshold: float) -> int | None:
    steps, values = series(rows, key)
    return next((s for s, v in zip(steps, values) if s > WARM_UP and direction * (v - threshold) > 0), None)


def main(args: Args) -> None:
    K = args.staleness
    jobs = {("collapse", s): job(K, args.collapse_lr, s) for s in args.seeds}
    jobs |= {("stable", s): job(K, args.stable_lr, s) for s in args.seeds}
    jobs |= {("K0", s): job(0, args.collapse_lr, s) for s in args.seeds}
    runs = run_jobs(list(jobs.values()), args.output_dir, args.workers)
    rows = {key: runs[j.name]["rows"] for key, j in jobs.items()}
    collapsing = {s: collapse_step(rows[("collapse", s)]) for s in args.seeds}
    lines = [f"K = {K}: lr {args.collapse_lr:g} (collapse setting; stable at K = 0: final pass@1 "
             + ", ".join(f"{evals(rows[('K0', s)])[-1]['eval/pass@1']:.2f}" for s in args.seeds)
             + f") against lr {args.stable_lr:g} (stable reference), seeds {args.seeds}.", "",
             "reward collapse step per seed: " + ", ".join(f"s{s}: {c if c is not None else 'no collapse'}" for s, c in collapsing.items())
             + "; final pass@1 " + ", ".join(f"{evals(rows[('collapse', s)])[-1]['eval/pass@1']:.2f}" for s in args.seeds)
             + " (stable reference: " + ", ".join(f"{evals(rows[('stable', s)])[-1]['eval/pass@1']:.2f}" for s in args.seeds) + ")", "",
             f"| diagnostic | threshold (from the stable runs) | warned before the collapse | lead in steps (mean, per run) | "
             f"false alarms: crossed in the K = 0 runs at lr {args.collapse_lr:g}, which do not collapse |",
             "|---|---|---|---|---|"]
    thresholds = {}
    for key, direction in DIAGNOSTICS:
        stable_values = [v for s in args.seeds for step, v in zip(*series(rows[("stable", s)], key)) if step > WARM_UP]
        thresholds[key] = max(stable_values) if direction > 0 else min(stable_values)
        leads = []
        for s, c in collapsing.items():
            if c is None:
                continue
            crossed = first_crossing(rows[("collapse", s)], key, direction, thresholds[key])
            leads.append(None if crossed is None or crossed > c else c - crossed)
        warned = [x for x in leads if x is not None]
        false_alarms = sum(first_crossing(rows[("K0", s)], key, direction, thresholds[key]) is not None for s in args.seeds)
        lead = f"{statistics.mean(warned):.1f} ({', '.join('–' if x is None else str(x) for x in leads)})" if warned else "–"
        lines.append(f"| {key} ({'falls' if direction < 0 else 'rises'}) | {thresholds[key]:.3g} | {len(warned)}/{len(leads)} | "
                     f"{lead} | {false_alarms}/{len(args.seeds)} |")
    text = "\n".join(lines) + "\n"
    out = save_table("async_early_warning", text)
    plt = pyplot()
    if plt is None:
        return
    panels = [("reward/mean", +1), *DIAGNOSTICS]
    fig, axes = plt.subplots(3, 3, figsize=(14, 9), sharex=True)
    for ax, (key, direction) in zip(axes.flat, panels):
        for s in args.seeds:
            for arm, color in (("collapse", "C3"), ("stable", "C0")):
                steps, values = series(rows[(arm, s)], key)
                ax.plot(steps, values, color=color, alpha=0.7,
                        label=(f"lr {args.collapse_lr:g}" if arm == "collapse" else f"lr {args.stable_lr:g}") if s == args.seeds[0] else None)
            if collapsing[s] is not None:
                ax.axvline(collapsing[s], color="C3", lw=0.6, ls=":")
        if key in thresholds:
            ax.axhline(thresholds[key], color="k", lw=0.8, ls="--")
        ax.set(title=f"{key} (smoothed)", yscale="log" if key in ("offpolicy/behaviour_ratio_max", "offpolicy/behaviour_ratio_std") else "linear")
    axes.flat[0].legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"K = {K}: dotted = reward collapse, dashed = threshold from the stable runs")
    fig.tight_layout()
    fig.savefig(out / "async_early_warning.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
