"""The train/inference mismatch in training: grpo.py on SmolLM2-135M-Instruct sampling through vLLM, with and without TIS.

    python repro/real_model_engine.py                    # 3 arms x 10 steps, bf16, one at a time: ~25 min on 2 cores

The recipe of real_model_recipe.py (4 prompts x 8 completions, T 0.7, 128 new tokens, shaped reward, lr 1e-5), in
--dtype, for --steps, held-out pass@1 at the first and last step on --eval-prompts problems x 4 (postrl's sampler:
the evaluations compare across engines). Arms:
- hf: postrl's own sampler (its log-probs differ from the trainer's by rounding only: in float32 by ~1e-6, in bf16
  by about as much as vLLM's, benchmarks/results/engine_mismatch.md; not logged in a run);
- vllm: --engine vllm, the sampler's log-probs mu ignored by the loss (ratio against the trainer's pi_old);
- vllm_tis: --engine vllm --tis-cap 2, each token's surrogate times min(pi_old / mu, 2).
Reported per arm: the mismatch over training (mean |log ratio|, max |log ratio|, engine KL), the training reward
over the first and last 3 steps, grad norm, held-out pass@1 base -> final (± se), seconds per step and per push.
Needs vLLM (common/engine.py gives the install lines). Writes repro/results/<name>.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from real_model_recipe import RECIPES, Args as RecipeArgs, flags as recipe_flags
from runner import Job, command as runner_command, evals, over_steps, run_jobs, save_table

ARMS = {"hf": [], "vllm": ["--engine", "vllm"], "vllm_tis": ["--engine", "vllm", "--tis-cap", "2"]}


@dataclass
class Args:
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seed: int = 0
    dtype: str = "bfloat16"
    steps: int = 10
    eval_prompts: int = 16
    """held-out problems x 4 at the first and last step: a check that nothing broke, not a comparison (10 steps move
    pass@1 less than its standard error)"""
    recipe: str = "shaped_lr1e-5"
    output_dir: str = "runs/repro_real_model_engine"
    name: str = "real_model_engine"


def command(args: Args) -> str:
    """The command that writes this table (its first line): the arms, seed, dtype and budget, and each other flag not
    at its default."""
    always = ("arms", "seed", "dtype", "steps", "eval_prompts")
    return f"`{runner_command('repro/real_model_engine.py', args, always)}`"


def main(args: Args) -> None:
    for arm in args.arms:
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    base = [*recipe_flags(RecipeArgs(steps=args.steps, eval_every=0, eval_prompts=args.eval_prompts)), *RECIPES[args.recipe],
            "--dtype", args.dtype, "--seed", str(args.seed)]
    runs = run_jobs([Job(f"{arm}_{args.dtype}_s{args.seed}", "grpo.py", [*base, *ARMS[arm]]) for arm in args.arms],
                    args.output_dir)
    lines = [f"{command(args)}: recipe {args.recipe}; mismatch = the sampler's "
             "log-probs mu against the trainer's pi_old at the same weights, over each step's completion tokens "
             "(mean over steps; max: over steps of each step's max)", "",
             "| arm | mean abs log ratio | max abs log ratio | engine KL | reward: first 3 -> last 3 steps | grad norm | "
             "held-out pass@1: base -> final | s per step | push (s) | wall (s) |", "|---" * 10 + "|"]
    for arm in args.arms:
        run = runs[f"{arm}_{args.dtype}_s{args.seed}"]
        rows, e = run["rows"], evals(run["rows"])
        trained = [r for r in rows if "time/train_s" in r]
        if arm == "hf":  # not logged: grpo.py takes pi_old from its forward; bf16 rounding alone: engine_mismatch.md
            mismatch = "not logged | - | -"
        else:
            mismatch = (f"{over_steps(trained, 'offpolicy/engine_log_ratio_mean'):.2e} | "
                        f"{over_steps(trained, 'offpolicy/engine_log_ratio_max', max):.2e} | "
                        f"{over_steps(trained, 'offpolicy/engine_kl'):.2e}")
        push = f"{over_steps(trained, 'time/engine_push_s'):.2f}" if arm != "hf" else "-"
        per_step = over_steps(trained, "time/rollout_s") + over_steps(trained, "time/train_s")
        lines.append(f"| {arm} | {mismatch} | {over_steps(trained[:3], 'reward/mean'):.3f} -> "
                     f"{over_steps(trained[-3:], 'reward/mean'):.3f} | {over_steps(trained, 'policy/grad_norm'):.2f} | "
                     f"{e[0]['eval/pass@1']:.3f} ± {e[0]['eval/pass@1_se']:.3f} -> {e[-1]['eval/pass@1']:.3f} ± "
                     f"{e[-1]['eval/pass@1_se']:.3f} | {per_step:.1f} | {push} | {run['wall_s']:.0f} |")
    save_table(args.name, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
