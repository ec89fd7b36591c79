"""Early warning on both jobs: which diagnostic reveals stale rollouts before held-out accuracy shows the damage, on
the embedded job and on SmolLM2-135M-Instruct alike?

    python repro/early_warning_across.py     # the embedded runs (~8 minutes, two at a time), then one table

Runs. Embedded: async_grpo.py --mode emulated at async_corrections.py's setting (lr 5e-4, 200 steps) with K = 0, 1
(tis), 2 (none), 4 (none, tis) and 8 (none), and at async_early_warning.py's collapse setting (K = 8, none, lr 2e-3,
100 steps) with K = 0 at that learning rate, 3 seeds each. Real model: every per-step log of real_model_staleness.py's
runs in repro/results/logs/ (its K = 0 is the recipe's grpo.py run, logs/repro_real_model_recipe/, and seed 2's is the
study-run benchmark's), as many as are there: the real runs are made by real_model_staleness.py, not here.

Labels come from the held-out evaluations a user sees, by one rule on both jobs. A stale run is *in trouble* from the
first evaluation at which its pass@1 is below that of the K = 0 run of the same seed and setting by more than two
standard errors of the difference, there and at every later evaluation; otherwise it is *healthy*. K = 0 runs are
healthy by definition. (Collapsed runs, runner.collapsed, are in trouble by this rule; the table says which.)

Thresholds, per job, from its healthy runs: the largest value a diagnostic (smoothed over 5 steps, from step 2: step
1 is on-policy everywhere) reached in any of them if it rises before trouble, the smallest if it falls. A troubled
run is warned if its smoothed diagnostic crosses the threshold at or before the evaluation that showed the trouble;
the lead is that evaluation's step minus the crossing step. A false alarm is a crossing anywhere in a healthy stale
run, with the threshold set on the job's other healthy runs (leave one out; on K = 0 runs the behaviour metrics are
constant, mu = pi_old, so their false alarms are counted on the stale healthy runs only). The transfer columns apply
the embedded job's thresholds to the real model unchanged. Writes repro/results/early_warning_across.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import tyro
from async_corrections import job as corrections_job
from async_lr_staleness import job as lr_job
from runner import LOGS, collapsed, evals, k0_logs, pyplot, read_log, run_jobs, save_table, smooth

WARM_UP = 1  # step 1 trains on version 0's own samples in every run
WINDOW = 5
DIAGNOSTICS = [  # (metric, direction): +1 rises before trouble, -1 falls; policy/kl_ref is not logged at beta 0 (real)
    ("offpolicy/behaviour_kl", +1), ("offpolicy/ess", -1), ("offpolicy/behaviour_ratio_max", +1),
    ("offpolicy/behaviour_ratio_std", +1), ("offpolicy/behaviour_ratio_p99", +1), ("offpolicy/moved_frac", +1),
    ("offpolicy/pos_above_1.2", +1), ("policy/clip_frac", +1), ("policy/entropy", +1), ("policy/grad_norm", +1),
]
ON_POLICY = {"offpolicy/behaviour_kl": 0.0, "offpolicy/ess": 1.0, "offpolicy/behaviour_ratio_max": 1.0,
             "offpolicy/behaviour_ratio_std": 0.0, "offpolicy/behaviour_ratio_p99": 1.0, "offpolicy/moved_frac": 0.0,
             "offpolicy/pos_above_1.2": 0.0}  # grpo.py logs no behaviour metrics: at K = 0, w = 1


@dataclass(eq=False)  # runs compare by identity
class Run:
    job: str  # "embedded" or "real"
    name: str
    K: int
    seed: int
    rows: list[dict]
    reference: Run | None = None  # the K = 0 run of the same seed and setting


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """the embedded runs' seeds"""
    output_dir: str = "runs/repro_early_warning"
    workers: int = 2
    leave_out: list[str] = field(default_factory=list)
    """real-model runs to leave out by name (e.g. K4_tis_cap3_s0): how much one run's label moves the thresholds"""
    name: str = "early_warning_across"
    """the results file's name in repro/results/"""


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]] | None:
    """The smoothed per-step series of a diagnostic from step 2 on; None if the run did not log it."""
    trained = [r for r in rows if "loss" in r]
    if key == "policy/clip_frac" and all("policy/clip_frac_low" in r for r in trained):
        values = [r["policy/clip_frac_low"] + r["policy/clip_frac_high"] for r in trained]
    elif all(key in r for r in trained):
        values = [r[key] for r in trained]
    elif key in ON_POLICY and not any("offpolicy/behaviour_kl" in r for r in trained):
        values = [ON_POLICY[key]] * len(trained)  # grpo.py
    else:
        return None
    smoothed = smooth(values, WINDOW)
    keep = [i for i, r in enumerate(trained) if r["step"] > WARM_UP]
    return [trained[i]["step"] for i in keep], [smoothed[i] for i in keep]


def trouble_step(run: Run) -> int | None:
    """The first evaluation from which the run's held-out pass@1 stays more than 2 standard errors of the difference
    below its K = 0 reference's at the same step; None if it never does (healthy)."""
    if run.reference is None:
        return None
    reference = {r["step"]: r for r in evals(run.reference.rows)}
    below = [(e["step"], e["eval/pass@1"] + 2 * (e["eval/pass@1_se"] ** 2 + reference[e["step"]]["eval/pass@1_se"] ** 2) ** 0.5
              < reference[e["step"]]["eval/pass@1"]) for e in evals(run.rows) if e["step"] in reference and e["step"] > 0]
    for i, (step, _) in enumerate(below):
        if all(b for _, b in below[i:]):
            return step
    return None


def first_crossing(run: Run, key: str, direction: int, threshold: float) -> int | None:
    steps, values = series(run.rows, key)
    return next((s for s, v in zip(steps, values) if direction * (v - threshold) > 0), None)


def threshold(runs: list[Run], key: str, direction: int) -> float | None:
    """The healthy runs' extreme; for a behaviour metric, from the stale ones only (at K = 0 it is a constant)."""
    runs = [r for r in runs if r.K > 0 or key not in ON_POLICY]
    values = [v for r in runs if (s := series(r.rows, key)) for v in s[1]]
    return (max(values) if direction > 0 else min(values)) if values else None


def score(key: str, direction: int, troubled: list[Run], healthy: list[Run], fixed: float | None = None) -> dict:
    """Warnings, leads and false alarms of one diagnostic on one job's runs. fixed: a threshold from elsewhere (the
    transfer test); else the threshold is this job's healthy runs' extreme, left out one at a time for false alarms."""
    logged = [r for r in healthy if series(r.rows, key)]
    limit = fixed if fixed is not None else threshold(logged, key, direction)
    leads = []
    for run in troubled:
        if limit is None or not series(run.rows, key):
            continue
        crossed = first_crossing(run, key, direction, limit)
        leads.append(None if crossed is None or crossed > trouble_step(run) else trouble_step(run) - crossed)
    alarms, judged = 0, 0
    for run in logged:
        if run.K == 0 and key in ON_POLICY:
            continue  # constant by construction
        limit_without = fixed if fixed is not None else threshold([r for r in logged if r is not run], key, direction)
        if limit_without is None:
            continue
        judged += 1
        alarms += first_crossing(run, key, direction, limit_without) is not None
    return {"threshold": limit, "leads": leads, "alarms": alarms, "judged": judged}


def cells(result: dict) -> list[str]:
    leads, warned = result["leads"], [x for x in result["leads"] if x is not None]
    lead = (f"{statistics.mean(warned):.1f} ({', '.join('–' if x is None else str(x) for x in leads)})" if warned else "–")
    limit = "–" if result["threshold"] is None else f"{result['threshold']:.3g}"
    return [limit, f"{len(warned)}/{len(leads)}", lead, f"{result['alarms']}/{result['judged']}"]


def embedded_runs(args: Args) -> list[Run]:
    settings = [(0, "none"), (1, "tis"), (2, "none"), (4, "none"), (4, "tis"), (8, "none")]
    jobs = {("lr5e-4", K, c, s): corrections_job(K, c, s) for K, c in settings for s in args.seeds}
    jobs |= {("lr2e-3", K, "none", s): lr_job(K, 2e-3, s) for K in (0, 8) for s in args.seeds}
    done = run_jobs(list(jobs.values()), args.output_dir, args.workers)
    runs = {key: Run("embedded", f"{key[0]} {j.name}", key[1], key[3], done[j.name]["rows"]) for key, j in jobs.items()}
    for (lr, K, c, s), run in runs.items():
        run.reference = runs[(lr, 0, "none", s)] if K else None
    return list(runs.values())


def real_runs(leave_out=()) -> list[Run]:
    """Every logged real-model staleness run, each with its seed's K = 0 run (runner.k0_logs: the recipe's grpo.py)."""
    refs = {s: Run("real", f"K0_s{s}", 0, s, read_log(p)) for s, p in k0_logs().items()}
    runs = list(refs.values())
    for path in sorted(p for p in (LOGS / "repro_real_model_staleness").glob("K*_s*.jsonl") if p.stem not in leave_out):
        arm, seed = path.stem.rsplit("_s", 1)
        runs.append(Run("real", path.stem, int(arm[1]), int(seed), read_log(path), refs.get(int(seed))))
    return [r for r in runs if r.K == 0 or r.reference is not None]  # a stale run without its K = 0 run has no label


def describe(runs: list[Run]) -> str:
    out = []
    for r in runs:
        if r.K == 0:
            continue
        t = trouble_step(r)
        last = evals(r.rows)[-1]
        out.append(f"{r.name} ({last['eval/pass@1']:.3f} vs K = 0 {evals(r.reference.rows)[-1]['eval/pass@1']:.3f} at step "
                   f"{last['step']}): " + ("healthy" if t is None else f"in trouble from step {t}"
                                           + (", collapsed" if collapsed(r.rows) else "")))
    return "; ".join(out)


def main(args: Args) -> None:
    jobs = {"embedded": embedded_runs(args), "real": real_runs(args.leave_out)}
    split = {job: ([r for r in runs if r.reference is not None and trouble_step(r) is not None],
                   [r for r in runs if r.reference is None or trouble_step(r) is None]) for job, runs in jobs.items()}
    lines = [f"Runs and labels. {job}: {describe(runs)}" for job, runs in jobs.items()]
    lines += ["", "| diagnostic | embedded: threshold | warned | lead (steps) | false alarms | real: threshold | warned | lead "
              "(steps) | false alarms | real with the embedded threshold: warned | lead | false alarms |", "|---" * 13 + "|"]
    for key, direction in DIAGNOSTICS:
        embedded = score(key, direction, *split["embedded"])
        real = score(key, direction, *split["real"])
        transfer = score(key, direction, *split["real"], fixed=embedded["threshold"]) if embedded["threshold"] is not None else None
        lines.append(f"| {key} ({'falls' if direction < 0 else 'rises'}) | " + " | ".join(
            [*cells(embedded), *cells(real), *(cells(transfer)[1:] if transfer else ["–"] * 3)]) + " |")
    out = save_table(args.name, "\n\n".join(lines[:len(jobs)]) + "\n\n" + "\n".join(lines[len(jobs):]) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(DIAGNOSTICS) // 2, figsize=(18, 7), sharex=True)
    for ax, (key, direction) in zip(axes.flat, DIAGNOSTICS):
        troubled, healthy = split["real"]
        for run in healthy + troubled:
            s = series(run.rows, key)
            if s and not (run.K == 0 and key in ON_POLICY):
                ax.plot(*s, color="C3" if run in troubled else "C0", alpha=0.7, lw=1)
        for job, style in (("embedded", ":"), ("real", "--")):
            limit = threshold([r for r in split[job][1] if series(r.rows, key)], key, direction)
            if limit is not None:
                ax.axhline(limit, color="k", lw=0.8, ls=style)
        ax.set(title=key, yscale="log" if "ratio_max" in key or "ratio_std" in key else "linear")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle("SmolLM2 runs (smoothed over 5 steps): red in trouble, blue healthy; "
                 "thresholds from healthy runs: dashed real, dotted embedded")
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=100)


if __name__ == "__main__":
    main(tyro.cli(Args))
