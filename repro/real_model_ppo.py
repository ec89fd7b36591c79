"""GRPO against PPO beyond the critic, on SmolLM2-135M-Instruct (issue 34, part 4; question 1 of the README).

    python repro/real_model_ppo.py                          # every arm x --seeds, one at a time, then the table
    python repro/real_model_ppo.py --arms equal --seeds 0

ppo.py on real_model_recipe.py's chosen recipe (the same 4 prompts x 8 completions a step, T 0.7, 128 new tokens,
shaped reward, lr 1e-5, no KL penalty: --kl-coef 0 for grpo.py's --beta 0, and no extra penalty for a completion
without EOS, so both algorithms see the same rewards), against the recipe's own grpo.py runs (their kept logs,
repro/results/logs/repro_real_model_recipe/). What differs is the advantage estimator (a learned value and GAE
against the group mean) and how many optimiser steps a batch gets. Arms (ARMS below):
- defaults: ppo.py's defaults, 4 epochs x 4 minibatches = 16 optimiser steps a batch, the value head on the
  policy's body (its gradient flows through the shared body).
- equal: 1 epoch x 1 minibatch, one optimiser step a batch as grpo.py's recipe takes: the critic apart from the
  number of steps.
- equal_separate: as equal, with the value function a separate copy of the model (--critic separate): the value
  loss's gradient kept out of the policy's body (with --gradient-checkpointing, to fit two models' activations in 24 GB).
- equal_lam1: as equal, with GAE's lam = 1 (Monte-Carlo returns: every token's advantage is R - V(s_t), the whole
  reward, as in grpo.py where every token gets its sequence's advantage): isolates the decay of the reward's credit
  along a long completion.
- defaults_lam1: the defaults with lam = 1: the 16 optimiser steps a batch apart from GAE's decay.
- equal_lam1_lr16x: equal_lam1 at 16x the learning rate (1.6e-4): as far a batch as 16 steps, no sample reused.
- minibatches4_lam1: 1 epoch x 4 minibatches at lam = 1: 4 optimiser steps a batch, each sample used once.
- epochs4_lam1: 4 epochs x 1 minibatch at lam = 1: 4 optimiser steps a batch, each sample used 4 times.
Reported: held-out and transfer pass@1 at the first and last evaluation (± se over prompts), steps to --target,
sampling and training seconds a step, the ratio's largest value and the clipped share, approx KL(pi_old, pi_theta)
over the epochs' passes (the mean over every minibatch's forward, each before its own step), the value's explained
variance, collapse, wall time and peak memory. Writes repro/results/<name>.{md,png}.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from real_model_recipe import RECIPES, Args as RecipeArgs, flags as recipe_flags, with_recipe
from runner import (LOGS, Job, collapsed, command as runner_command, evals, first_step_reaching, k0_logs, mean_sd,
                    over_steps, pyplot, read_log, run_jobs, save_table)

ARMS = {  # name: ppo.py flags on top of the recipe's
    "defaults": ["--ppo-epochs", "4", "--minibatches", "4"],
    "equal": ["--ppo-epochs", "1", "--minibatches", "1"],
    # a second model's activations do not fit 24 GB beside the policy's (killed for memory at step 2, 2026-12-06):
    # recomputed in the backward pass, the same gradients up to rounding, at about a third more compute
    "equal_separate": ["--ppo-epochs", "1", "--minibatches", "1", "--critic", "separate", "--gradient-checkpointing"],
    # the mechanism of equal's collapse to "#### N" (repro/README.md): GAE's lam = 0.95 gives a token 100 tokens before
    # the reward 0.95^100 = 0.6 % of it, a 4-token answer all of it; lam = 1 gives every token R - V(s_t)
    "equal_lam1": ["--ppo-epochs", "1", "--minibatches", "1", "--lam", "1.0"],
    # the defaults collapse as well (held-out 0.100 -> 0.020, seed 0) with long answers kept: lam = 1 at 16 steps a
    # batch separates what the 16 optimiser steps do from what lam does
    "defaults_lam1": ["--ppo-epochs", "4", "--minibatches", "4", "--lam", "1.0"],
    # which part of the 16 steps breaks defaults_lam1. One step of 16x the lr: Adam moves a weight by about lr a step
    # whatever the gradient's size, so this goes up to as far a batch as 16 steps, no sample reused, no clip binding
    "equal_lam1_lr16x": ["--ppo-epochs", "1", "--minibatches", "1", "--lam", "1.0", "--lr", "1.6e-4"],
    # 4 steps a batch, each sample used once, against 4 steps with each used 4 times (the reuse at equal steps); the
    # latter's whole batch of 32 a step did not fit 24 GB 4 times over (killed at step 1): activations recomputed
    "minibatches4_lam1": ["--ppo-epochs", "1", "--minibatches", "4", "--lam", "1.0"],
    "epochs4_lam1": ["--ppo-epochs", "4", "--minibatches", "1", "--lam", "1.0", "--gradient-checkpointing"],
    # issue 53, VC-PPO (Yuan et al. 2025): one step a batch at the actor's lam 0.95 with the critic's returns at lam 1
    # (decoupled GAE) and 4 batches of the initial policy training the critic alone first (value warm-up), 44 steps so
    # that the policy takes the 40 updates of the arms it is compared with, the critic at 10x the actor's lr (as verl's
    # PPO recipes set it: at the actor's 1e-5 the value head's explained variance stays near 0 for 12 steps, so a
    # warm-up of 4 would move it little); and each part alone (probes)
    "equal_vcppo": ["--ppo-epochs", "1", "--minibatches", "1", "--critic-lam", "1.0", "--value-warmup-steps", "4",
                    "--steps", "44", "--vf-lr", "1e-4"],
    "equal_critic_lam1": ["--ppo-epochs", "1", "--minibatches", "1", "--critic-lam", "1.0", "--vf-lr", "1e-4"],
    "equal_warmup": ["--ppo-epochs", "1", "--minibatches", "1", "--value-warmup-steps", "4", "--steps", "44",
                     "--vf-lr", "1e-4"],
}


@dataclass
class Args:
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    steps: int = 40
    eval_every: int = 20
    eval_prompts: int = 100
    target: float = 0.18
    """held-out pass@1 for the steps to target"""
    output_dir: str = "runs/repro_real_model_ppo"
    name: str = "real_model_ppo"
    finished_only: bool = False
    """tabulate the runs of --arms x --seeds that have finished and start none (a study spread over sessions)"""


def ppo_flags(args: Args) -> list[str]:
    """The recipe's grpo.py flags, spoken to ppo.py: --beta 0 becomes --kl-coef 0 (no reference model is loaded)."""
    base = with_recipe(recipe_flags(RecipeArgs(steps=args.steps, eval_every=args.eval_every, eval_prompts=args.eval_prompts)),
                       RECIPES["shaped_lr1e-5"])
    i = base.index("--beta")
    return [*base[:i], "--kl-coef", base[i + 1], *base[i + 2:], "--no-eos-penalty", "None"]


def grpo_run(seed: int) -> dict | None:
    """The recipe's grpo.py run of this seed from its kept log (metrics rows, wall time, peak memory), if there is one:
    runner.k0_logs' (the recipe study's own, else the study-run benchmark's run of the same flags)."""
    path = k0_logs().get(seed)
    if path is None:
        return None
    return {"rows": read_log(path), **json.loads(path.read_text().splitlines()[-1]), "log": path.relative_to(LOGS)}


def command(args: Args) -> str:
    """The command that writes this table (its first line): the arms, seeds, budget and target, and each other flag not
    at its default."""
    always = ("arms", "seeds", "steps", "eval_every", "eval_prompts", "target")
    return f"`{runner_command('repro/real_model_ppo.py', args, always)}`"


def main(args: Args) -> None:
    for arm in args.arms:
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    base = ppo_flags(args)
    cache = ["--eval-cache", str(Path(args.output_dir).parent / "eval_cache")]  # shared with the staleness study
    jobs = {(arm, seed): Job(f"{arm}_s{seed}", "ppo.py", [*base, *ARMS[arm], *cache, "--seed", str(seed)])
            for arm in args.arms for seed in args.seeds}
    done = run_jobs(list(jobs.values()), args.output_dir, start=not args.finished_only)
    runs = {("grpo.py", seed): run for seed in args.seeds if (run := grpo_run(seed))}
    runs |= {key: done[j.name] for key, j in jobs.items() if j.name in done}
    for run in runs.values():
        run["rows"] = [r for r in run["rows"] if r["step"] <= args.steps]

    lines = [command(args), "",
             "grpo.py: the recipe's own runs, from their kept logs in repro/results/logs/: " + ", ".join(
                 f"seed {seed} {run['log']}" for (arm, seed), run in runs.items() if arm == "grpo.py") + ".", "",
             "| arm | seed | held-out pass@1: base -> final | transfer pass@1: base -> final | greedy: base -> final | "
             f"steps to {args.target} | sampling, training s a step | ratio max (mean, max over steps) | clipped (%) | "
             "approx KL over the passes | value explained variance (median, last 10) | collapsed | wall time (s) | peak memory (MB) |",
             "|---" * 14 + "|"]
    for (arm, seed), run in runs.items():
        rows, e = run["rows"], evals(run["rows"])
        trained = [r for r in rows if "time/train_s" in r]
        reach = first_step_reaching(rows, "eval/pass@1", args.target)
        clipped = 100 * (over_steps(trained, "policy/clip_frac_low") + over_steps(trained, "policy/clip_frac_high"))
        ev = over_steps(trained[-10:], "value/explained_variance", statistics.median)  # a mean is swamped by steps whose
        # returns are all equal (1 - var(R - V) / var(R) with var(R) ~ 0)
        cells = [arm, str(seed),
                 *(f"{e[0][p + 'pass@1']:.3f} ± {e[0][p + 'pass@1_se']:.3f} -> {e[-1][p + 'pass@1']:.3f} ± "
                   f"{e[-1][p + 'pass@1_se']:.3f}" for p in ("eval/", "eval/transfer/")),
                 f"{e[0]['eval/greedy']:.2f} -> {e[-1]['eval/greedy']:.2f}", "never" if reach is None else str(reach),
                 f"{over_steps(trained, 'time/rollout_s'):.1f}, {over_steps(trained, 'time/train_s'):.1f}",
                 f"{over_steps(trained, 'policy/ratio_max'):.3g}, {over_steps(trained, 'policy/ratio_max', max):.3g}",
                 f"{clipped:.2f}", f"{over_steps(trained, 'policy/approx_kl'):.2g}" if arm != "grpo.py" else "–",
                 "–" if ev != ev else f"{ev:.2f}", "yes" if collapsed(rows) else "no", f"{run['wall_s']:.0f}",
                 f"{run['peak_rss_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    arms = ["grpo.py", *args.arms]
    finals = {arm: [run["rows"] for (a, _), run in runs.items() if a == arm] for arm in arms}
    lines += ["", "final held-out pass@1 by arm (mean ± sd over seeds): " + ", ".join(
        f"{arm} {mean_sd([evals(r)[-1]['eval/pass@1'] for r in rows])}" for arm, rows in finals.items() if rows)]
    out = save_table(args.name, "\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, arm in enumerate(arms):
        for j, rows in enumerate(finals[arm]):
            e, label = evals(rows), arm if j == 0 else None
            trained = [r for r in rows if "time/train_s" in r]
            axes[0].errorbar([r["step"] for r in e], [r["eval/pass@1"] for r in e], yerr=[r["eval/pass@1_se"] for r in e],
                             color=f"C{i}", marker="o", capsize=2, alpha=0.8, label=label)
            axes[1].plot([r["step"] for r in trained], [r["reward/mean"] for r in trained], color=f"C{i}", alpha=0.8, label=label)
            axes[2].plot([r["step"] for r in trained], [r["policy/ratio_max"] for r in trained], color=f"C{i}", alpha=0.8,
                         label=label)
    axes[0].axhline(args.target, color="grey", lw=0.5)
    axes[0].set(xlabel="step", ylabel="held-out pass@1 (± se)")
    axes[1].set(xlabel="step", ylabel="training reward (mean)")
    axes[2].set(xlabel="step", ylabel="largest ratio pi_theta / pi_old", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
