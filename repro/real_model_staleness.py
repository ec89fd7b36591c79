"""Staleness on a real model: the embedded study's questions asked of SmolLM2-135M-Instruct.

    python repro/real_model_staleness.py                 # the runs in --arms x --seeds, one at a time, then the table
    python repro/real_model_staleness.py --arms K2_none --seeds 0

Every run uses real_model_recipe.py's flags and its chosen recipe (--recipe: 4 prompts x 8 completions, T 0.7,
128 new tokens, beta 0, shaped reward, lr 1e-5; held-out and transfer evaluation of --eval-prompts problems x 4).
Arms (ARMS below):
- K0: staleness 0. async_grpo.py --mode emulated at K = 0 is grpo.py bit for bit for every correction (a test:
  tests/test_async_grpo.py; `--check-k0` repeats it on this model for 2 steps), so K = 0 is the recipe's own grpo.py
  run, shared with real_model_recipe.py (its output directory).
- K2_none, K4_none: async_grpo.py --mode emulated, batch t sampled from exactly version t - 1 - K, no correction
  (the behaviour policy mu is taken as pi_old, "bypass").
- K4_tis: K = 4 with truncated importance sampling, the correction that reached the embedded job's target in
  the fewest steps at K = 4 (137 steps, 3 of 3 seeds; decoupled: 160; none: 1 of 3; repro/README.md).
- K4_icepop, K4_decoupled: the other corrections that did best on the embedded job at K = 4 and 8 (issue 34, part 2).
- K1_tis: the threaded arm's staleness and correction, emulated (the thread's effect apart from K's).
- K4_tis_cap5, K4_tis_cap3, K4_decoupled_cap2, K4_none_2iter: what separates tis from icepop and decoupled at K = 4
  (part 2): the size of the bound on w (C = 2 holds, 5 collapses; 3 between), truncating against dropping, and a
  second pass (the clip on u binds again).
- K4_none_noclip: K4_none with the clip opened (eps_low 0.999, eps_high 1e6), checkpointed every 10 steps: does the
  clip against the stale mu cut the tokens being learned (the candidate mechanism of K4_none's stall)?
- threaded: async_grpo.py as a user starts it (a generation thread, K = 1, tis) for the wall time to the same
  held-out accuracy as grpo.py. Compute time = learner wait + train per step (grpo.py: sampling + train), so
  the evaluations are left out of both; during an evaluation the generator may sample at most one batch ahead.

Reported, as the embedded study does: held-out and transfer pass@1 at the first and last evaluation (± se),
steps and compute seconds to --target held-out pass@1, behaviour KL (k3 of KL(mu, pi_old)) and ESS over
training, and whether any run collapses (final held-out pass@1 below the base model's or below half its best);
the figure shows held-out pass@1 by step and behaviour KL by step, the early-warning signal of the embedded
study. Writes repro/results/<name>.{md,png}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from real_model_recipe import RECIPES, Args as RecipeArgs, flags as recipe_flags, with_recipe
from runner import (ROOT, Job, collapsed, command as runner_command, evals, first_step_reaching, mean_sd, over_steps,
                    pyplot, run_jobs, save_table)

ARMS = {  # name: (script, flags); K0 is the recipe's grpo.py run, in the recipe's directory
    "K0": ("grpo.py", []),
    "K1_tis": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "1", "--correction", "tis"]),  # threaded's K
    "K2_none": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "2", "--correction", "none"]),
    "K4_none": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "none"]),
    "K4_tis": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "tis"]),
    # issue 34, part 2: the other corrections that did best on the embedded job (repro/README.md, "Every correction
    # under the same lag": icepop the highest final pass@1 at K = 4, decoupled at K = 8)
    "K4_icepop": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "icepop"]),
    "K4_decoupled": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "decoupled"]),
    # issue 34's mechanism: K = 4 bypass with the clip on r = pi_theta / mu opened ([0.001, 1e6]: no token cut)
    "K4_none_noclip": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "none",
                                         "--eps-low", "0.999", "--eps-high", "1e6", "--save-every", "10"]),
    # what separates tis (learns) from icepop and uncapped decoupled (collapse) at one pass, where the clip on u never
    # binds: the size of the bound on w (tis at C = 5, icepop's upper edge), or truncating against dropping (decoupled
    # dropping where tis truncates, w > 2); and K = 4 at two passes, where the clip on u binds again
    "K4_tis_cap5": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "tis",
                                      "--tis-cap", "5"]),
    "K4_tis_cap3": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "tis",
                                      "--tis-cap", "3"]),  # between the bound that holds (2) and the one that does not (5)
    "K4_decoupled_cap2": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "decoupled",
                                            "--decoupled-cap", "2"]),
    "K4_none_2iter": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "none",
                                        "--num-iterations", "2"]),
    "threaded": ("async_grpo.py", ["--mode", "threaded", "--max-staleness", "1", "--correction", "tis"]),
    # issue 53: VCPO (Huang et al. 2026) at K = 4, and the sequence-level corrections (verl's seq_is / seq_mis) as probes
    "K4_vcpo": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "vcpo"]),
    "K4_seq_tis": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "seq-tis"]),
    "K4_seq_mis": ("async_grpo.py", ["--mode", "emulated", "--max-staleness", "4", "--correction", "seq-mis"]),
}


@dataclass
class Args:
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """seeds of the learning arms; the threaded arm runs seed 0 only (its question is time, not spread)"""
    recipe: str = "shaped_lr1e-5"
    steps: int = 40
    eval_every: int = 20
    eval_prompts: int = 100
    target: float = 0.18
    """held-out pass@1 for steps and seconds to target"""
    output_dir: str = "runs/repro_real_model_staleness"
    name: str = "real_model_staleness"
    finished_only: bool = False
    """tabulate the runs of --arms x --seeds that have finished and start none (a study spread over sessions)"""
    pool_with: list[str] = field(default_factory=list)
    """other tables of this study (repro/results/<name>.md) whose runs join this table's in a pooled line: each run of
    an arm one draw (a rerun of a seed is another run: the products' order alone flips a draw and the runs part)"""
    check_k0: bool = False
    """first run grpo.py and async_grpo.py --mode emulated --max-staleness 0 for 2 steps on this model and stop
    unless their logged numbers are identical"""


WARNING = [("offpolicy/behaviour_kl", "behaviour KL"), ("offpolicy/ess", "ESS"), ("policy/clip_frac", "clipped"),
           ("policy/entropy", "entropy"), ("policy/grad_norm", "grad norm"),
           ("offpolicy/behaviour_ratio_p99", "w p99"), ("offpolicy/moved_frac", "moved > 2x"),
           ("offpolicy/pos_above_1.2", "A > 0 with w > 1.2")]
ON_POLICY = {"offpolicy/behaviour_kl": 0.0, "offpolicy/ess": 1.0, "offpolicy/behaviour_ratio_p99": 1.0,
             "offpolicy/moved_frac": 0.0, "offpolicy/pos_above_1.2": 0.0}  # mu = pi_old: w = 1


def diagnostic(rows: list[dict], key: str) -> float | None:
    """Mean over rows of a diagnostic; K = 0 logs no behaviour metrics (w = 1: ON_POLICY); None where a stale run
    did not log it (the three last candidates are logged since issue 34)."""
    if key == "policy/clip_frac":
        return over_steps(rows, "policy/clip_frac_low") + over_steps(rows, "policy/clip_frac_high")
    if not any(key in r for r in rows):
        return None if any("offpolicy/behaviour_kl" in r for r in rows) else ON_POLICY[key]
    return over_steps(rows, key)


def cell(early: float | None, late: float | None) -> str:
    return "–" if early is None else f"{early:.3g} -> {late:.3g}"


def compute_seconds(rows: list[dict], up_to: int | None = None) -> float:
    """Sampling (or waiting for the generator) + training, summed over steps <= up_to (all if None): evaluation
    left out."""
    wait = "time/learner_wait_s" if any("time/learner_wait_s" in r for r in rows) else "time/rollout_s"
    return sum(r[wait] + r["time/train_s"] for r in rows if "time/train_s" in r and (up_to is None or r["step"] <= up_to))


def table_runs(text: str) -> dict[tuple[str, str, str], float]:
    """{(arm, seed, wall time): final held-out pass@1} of each row of a staleness table's first table (its third column,
    'base ± se -> final ± se'); a run that two tables read (part 2 reads part 1's logs) has one key."""
    runs, header = {}, False
    for line in text.splitlines():
        if line.startswith("| arm | seed | held-out pass@1"):
            header = True
        elif header and not line.startswith("|"):
            break
        elif header and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            runs[(cells[0], cells[1], cells[-1])] = float(cells[2].split("->")[1].split("±")[0])
    return runs


def pooled(runs: dict[tuple[str, str, str], float], arms: list[str], reference: str = "K0") -> str:
    """Each arm's mean ± standard error over its runs (n), then the reference arm less each other arm, in standard
    errors of that difference (the two means' errors taken as independent)."""
    finals = {arm: [v for (a, _, _), v in runs.items() if a == arm] for arm in arms}
    stats = {arm: (statistics.mean(v), statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan"), len(v))
             for arm, v in finals.items() if v}
    text = ", ".join(f"{arm} {m:.3f}" + (f" ± {se:.3f}" if n > 1 else "") + f" ({n})" for arm, (m, se, n) in stats.items())
    if reference not in stats or stats[reference][2] < 2:
        return text
    m0, se0, _ = stats[reference]
    gaps = [f"{reference} - {arm} {m0 - m:.3f} ({(m0 - m) / (se0 ** 2 + se ** 2) ** 0.5:.1f} se)"
            for arm, (m, se, n) in stats.items() if arm != reference and n > 1]
    return text + ("; " + ", ".join(gaps) if gaps else "")


def pass1(e: list[dict], prefix: str) -> str:
    """'base ± se -> final ± se' of the held-out pass@1 under prefix."""
    first, last = e[0], e[-1]
    return (f"{first[prefix + 'pass@1']:.3f} ± {first[prefix + 'pass@1_se']:.3f} -> "
            f"{last[prefix + 'pass@1']:.3f} ± {last[prefix + 'pass@1_se']:.3f}")


def check_k0(base: list[str], output_dir: str) -> None:
    """K = 0 emulated is grpo.py bit for bit by construction (the same draws from the same weights, the same loss
    code); the test suite checks it on the embedded model, this on the real one: every logged number but timings."""
    short = [*base, "--steps", "2", "--eval-every", "0", "--eval-prompts", "2"]  # evaluates at the first and last step
    runs = run_jobs([Job("check_k0_grpo", "grpo.py", short),
                     Job("check_k0_async", "async_grpo.py", [*short, "--mode", "emulated", "--max-staleness", "0"])], output_dir)
    grpo, emulated = (runs[n]["rows"] for n in ("check_k0_grpo", "check_k0_async"))
    for a, b in zip(grpo, emulated, strict=True):
        differ = [k for k in a if k in b and not k.startswith(("time/", "throughput/")) and a[k] != b[k]]
        if differ:
            raise SystemExit(f"K = 0 is not grpo.py at step {a['step']}: {differ}")
    print("K = 0 emulated == grpo.py: every logged number of 2 steps identical")


def command(args: Args) -> str:
    """The command that writes this table (its first line): the arms, seeds, budget and target, and each other flag not
    at its default."""
    always = ("arms", "seeds", "steps", "eval_every", "eval_prompts", "target")
    return f"`{runner_command('repro/real_model_staleness.py', args, always)}`"


def main(args: Args) -> None:
    for arm in args.arms:
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    for name in args.pool_with:
        if name == args.name or not (ROOT / "repro" / "results" / f"{name}.md").is_file():
            raise SystemExit(f"--pool-with: {name!r} is " + ("this table (--name)" if name == args.name else
                                                             "not a table in repro/results/"))
    if args.recipe not in RECIPES:
        raise SystemExit(f"--recipe: unknown recipe {args.recipe!r} (choose from {', '.join(RECIPES)})")
    base = with_recipe(recipe_flags(RecipeArgs(steps=args.steps, eval_every=args.eval_every, eval_prompts=args.eval_prompts)),
                       RECIPES[args.recipe])
    if args.check_k0:
        check_k0(base, args.output_dir)
    plan = [(arm, seed) for arm in args.arms for seed in (args.seeds if arm != "threaded" else [0])]

    cache = ["--eval-cache", str(Path(args.output_dir).parent / "eval_cache")]  # the base model evaluated once a seed

    def job(arm: str, seed: int) -> Job:
        if arm == "K0":  # grpo.py: the recipe's own run, in the recipe's directory (skipped when it has finished)
            return Job(f"{args.recipe}_s{seed}", "grpo.py", [*base, *cache, "--seed", str(seed)])
        return Job(f"{arm}_s{seed}", ARMS[arm][0], [*base, *ARMS[arm][1], *cache, "--seed", str(seed)])

    jobs = {(arm, seed): job(arm, seed) for arm, seed in plan}
    start = not args.finished_only
    done = {**run_jobs([j for (arm, _), j in jobs.items() if arm == "K0"], RecipeArgs().output_dir, start=start),
            **run_jobs([j for (arm, _), j in jobs.items() if arm != "K0"], args.output_dir, start=start)}
    runs = {key: done[j.name] for key, j in sorted(jobs.items(), key=lambda kv: (list(ARMS).index(kv[0][0]), kv[0][1]))
            if j.name in done}
    for run in runs.values():  # a longer run (the recipe's K = 0) is read up to --steps: lr is constant, so its
        run["ran"] = run["rows"][-1]["step"]  # first steps are those of a shorter run
        run["rows"] = [r for r in run["rows"] if r["step"] <= args.steps]

    lines = [command(args),
             "", f"| arm | seed | held-out pass@1: base -> final | transfer pass@1: base -> final | greedy: base -> final | "
             f"steps to {args.target} | compute s to {args.target} | s per step | behaviour KL (mean, max) | ESS (mean, min) | "
             "clipped low, high (%) | format reward, cut (last 10 steps) | collapsed | wall time (s) |", "|---" * 14 + "|"]
    for (arm, seed), run in runs.items():  # in ARMS order
        rows, e = run["rows"], evals(run["rows"])
        reach = first_step_reaching(rows, "eval/pass@1", args.target)
        trained = [r for r in rows if "time/train_s" in r]
        kl = (f"{over_steps(rows, 'offpolicy/behaviour_kl'):.3g}, {over_steps(rows, 'offpolicy/behaviour_kl', max):.3g}"
              if arm != "K0" else "0 (mu = pi_old)")
        ess = (f"{over_steps(rows, 'offpolicy/ess'):.3f}, {over_steps(rows, 'offpolicy/ess', min):.3f}" if arm != "K0" else "1")
        per_step = compute_seconds(rows) / len(trained)
        late = trained[-10:]  # the mechanism: which tokens the clip cut, and whether the format was learned
        clipped = f"{100 * over_steps(rows, 'policy/clip_frac_low'):.2f}, {100 * over_steps(rows, 'policy/clip_frac_high'):.2f}"
        shaped = (f"{over_steps(late, 'reward/gsm8k_format_reward'):.2f}, {over_steps(late, 'completions/clipped_frac'):.2f}")
        cells = [arm, str(seed), pass1(e, "eval/"), pass1(e, "eval/transfer/"),
                 f"{e[0]['eval/greedy']:.2f} -> {e[-1]['eval/greedy']:.2f}",
                 "never" if reach is None else str(reach), "never" if reach is None else f"{compute_seconds(rows, reach):.0f}",
                 f"{per_step:.1f}", kl, ess, clipped, shaped, "yes" if collapsed(rows) else "no",
                 f"{run['wall_s']:.0f}" + (f" (all {run['ran']} steps)" if run["ran"] > args.steps else "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The embedded study's early-warning diagnostics (repro/README.md, \"Early warning\"): mean over steps 2-10 "
              "-> over the last 10 steps (entropy and grad norm are the learner's; clipped = low + high)", "",
              "| arm | seed | " + " | ".join(name for _, name in WARNING) + " |", "|---" * (2 + len(WARNING)) + "|"]
    for (arm, seed), run in runs.items():
        trained = [r for r in run["rows"] if "time/train_s" in r]
        early, late = [r for r in trained if 2 <= r["step"] <= 10], trained[-10:]
        lines.append(f"| {arm} | {seed} | " + " | ".join(cell(diagnostic(early, key), diagnostic(late, key))
                                                         for key, _ in WARNING) + " |")
    finals = {arm: [runs[(arm, s)]["rows"] for s in args.seeds if (arm, s) in runs] for arm in args.arms}
    lines += ["", "final held-out pass@1 by arm (mean ± sd over seeds): " + ", ".join(
        f"{arm} {mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])}" for arm, rows in finals.items() if rows)]
    if args.pool_with:
        runs_read = table_runs("\n".join(lines))
        for name in args.pool_with:
            runs_read |= table_runs((ROOT / "repro" / "results" / f"{name}.md").read_text())
        lines += ["", f"pooled with the runs of {', '.join(args.pool_with)} (mean ± se over runs, n runs; a difference "
                      "in standard errors of the difference, runs independent): " + pooled(runs_read, args.arms)]
    out = save_table(args.name, "\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, arm in enumerate(args.arms):
        for j, rows in enumerate(finals.get(arm, [])):
            e, label = evals(rows), arm if j == 0 else None
            axes[0].errorbar([r["step"] for r in e], [r["eval/pass@1"] for r in e], yerr=[r["eval/pass@1_se"] for r in e],
                             color=f"C{i}", marker="o", capsize=2, alpha=0.8, label=label)
            trained = [r for r in rows if "time/train_s" in r]
            axes[1].plot([r["step"] for r in trained], [r.get("offpolicy/behaviour_kl", 0.0) for r in trained], color=f"C{i}",
                         alpha=0.8, label=label)
            axes[2].plot([r["step"] for r in trained], [r["reward/mean"] for r in trained], color=f"C{i}", alpha=0.8, label=label)
    axes[0].axhline(args.target, color="grey", lw=0.5)
    axes[0].set(xlabel="step", ylabel="held-out pass@1 (± se)")
    axes[1].set(xlabel="step", ylabel="behaviour KL (k3, mu vs pi_old)")
    axes[2].set(xlabel="step", ylabel="training reward (mean)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
