"""Towards a real-model recipe that holds: grpo.py on SmolLM2-135M-Instruct, evaluated on two held-out sets.

    python repro/real_model_recipe.py                  # the chosen recipe in three seeds, one at a time: ~2 h 20 min on 2 cores
    python repro/real_model_recipe.py --runs shaped_lr3e-6:0 accuracy_lr1e-5:0 --name real_model_sweep

Every run: 4 prompts x 8 completions a step (groups wide enough that most have a reward signal), temperature
0.7, at most 128 new tokens, beta 0, float32 on the CPU; held-out evaluation every --eval-every steps (and at
the first and last) on --eval-prompts problems x 4 samples of two sets: the training generator's own held-out
split (eval/...) and the transfer set of an independent generator, other situations and step structures
(eval/transfer/..., common/word_problems.py). Recipes (RECIPES below) vary the reward, the learning rate and
full fine-tuning against LoRA. Writes repro/results/real_model_recipe.{md,png}: each run's base -> final pass@1
(± its standard error over prompts), pass@4, greedy, format rate and length on both sets, the steps that had a
gradient, the share of completions cut at the budget, wall time and peak memory.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from runner import ROOT, Job, command as runner_command, evals, pyplot, run_jobs, save_table

from common import word_problems

DATA = ROOT / "data" / "word_problems"
SHAPED = ["--reward", "common.tasks:gsm8k_reward", "common.tasks:gsm8k_format_reward", "--reward-weights", "1", "0.2"]
RECIPES = {  # name: flags
    "shaped_lr1e-5": [*SHAPED, "--lr", "1e-5"],
    "shaped_lr3e-6": [*SHAPED, "--lr", "3e-6"],
    "accuracy_lr1e-5": ["--lr", "1e-5"],
    "shaped_lora_lr1e-4": [*SHAPED, "--lr", "1e-4", "--lora-r", "16", "--lora-alpha", "32"],
    # partial credit per intermediate result: multi-step prompts whose 8 completions all miss still rank them
    "stepwise_lr1e-5": ["--reward", "common.tasks:gsm8k_reward", "common.tasks:gsm8k_format_reward",
                        "common.tasks:gsm8k_steps_reward", "--reward-weights", "1", "0.2", "0.5", "--lr", "1e-5"],
    # multi-turn: the same problems asked one step a turn, each right turn credited (--task gsm8k-turns); the held-out
    # problems are evaluated multi-turn (eval/) and single-turn as the other recipes see them (eval/test/); trained one
    # group (of the 4) a micro-batch: trajectories ~3x a turn long, all 32 at once ran out of the machine's 24 GB
    "turns_lr1e-5": ["--task", "gsm8k-turns", "--extra-eval-data-path", str(DATA / "transfer.jsonl"),
                     str(DATA / "test.jsonl"), "--lr", "1e-5", "--minibatches", "4"],
    # the same at two passes a batch: at one pass the ratio is 1 and the clip never binds, at two the second pass's
    # ratio moves and its clip fraction by turn position (turns/clip_frac_t<k>) is the embedded chain tasks' question
    "turns2_lr1e-5": ["--task", "gsm8k-turns", "--extra-eval-data-path", str(DATA / "transfer.jsonl"),
                      str(DATA / "test.jsonl"), "--lr", "1e-5", "--minibatches", "4", "--num-iterations", "2"],
    # and with every token weighted alike (token-mean, not 1 / |trajectory| per trajectory): turn 1 holds the one-turn
    # trajectories, the shortest, whose tokens the default weighting moves more; this run separates length from place
    "turns2_tokenmean_lr1e-5": ["--task", "gsm8k-turns", "--extra-eval-data-path", str(DATA / "transfer.jsonl"),
                                str(DATA / "test.jsonl"), "--lr", "1e-5", "--minibatches", "4", "--num-iterations", "2",
                                "--loss-agg", "token-mean"],
}
# issue 53: GSPO against GRPO at two passes a batch (from the second pass the ratio moves and the clip binds), GSPO's
# sequence ratio clipped at its own range (3e-4, 4e-4)
RECIPES["shaped_2iter_lr1e-5"] = [*RECIPES["shaped_lr1e-5"], "--num-iterations", "2"]
RECIPES["gspo_2iter_lr1e-5"] = [*RECIPES["shaped_2iter_lr1e-5"], "--importance-level", "sequence"]
SETS = (("eval/", "held-out"), ("eval/transfer/", "transfer"), ("eval/test/", "held-out, single-turn"))


def with_recipe(base: list[str], recipe: list[str]) -> list[str]:
    """The base flags with those the recipe sets (--task, --extra-eval-data-path) taken out, then the recipe's."""
    named = {f for f in recipe if f.startswith("--")}
    kept, skip = [], False
    for f in base:
        skip = f in named or (skip and not f.startswith("--"))
        if not skip:
            kept.append(f)
    return [*kept, *recipe]


@dataclass
class Args:
    runs: list[str] = field(default_factory=lambda: [f"shaped_lr1e-5:{seed}" for seed in range(3)])
    """recipe:seed pairs, run one at a time (recipes: see RECIPES)"""
    steps: int = 40
    eval_every: int = 20
    eval_prompts: int = 100
    output_dir: str = "runs/repro_real_model_recipe"
    name: str = "real_model_recipe"
    """the results files: repro/results/<name>.{md,png}"""


def data() -> Path:
    """data/word_problems/, the problems every real-model study trains and evaluates on: not in git, so written on first
    use (common/word_problems.py builds them from fixed seeds: the same files on every machine)."""
    if not (DATA / "transfer.jsonl").is_file():
        word_problems.write(DATA)
    return DATA


def flags(args: Args) -> list[str]:
    """grpo.py's flags for the recipe (each study starts from them), with the data files they name written."""
    words = data()
    return ["--model", "smollm2-135m-instruct", "--task", "gsm8k", "--data-path", str(words / "train.jsonl"),
            "--eval-data-path", str(words / "test.jsonl"), "--extra-eval-data-path", str(words / "transfer.jsonl"),
            "--temperature", "0.7", "--max-new-tokens", "128", "--prompts-per-step", "4", "--num-generations", "8",
            "--beta", "0", "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--eval-prompts",
            str(args.eval_prompts), "--eval-samples", "4", "--eval-k", "4", "--save-every", "1000"]


def cell(first: dict, last: dict, key: str) -> str:
    if "length" in key:
        return f"{first[key]:.0f} -> {last[key]:.0f}"
    se = key.replace("pass@1", "pass@1_se") if key.endswith("pass@1") else None
    if se and se in last:
        return f"{first[key]:.3f} ± {first[se]:.3f} -> {last[key]:.3f} ± {last[se]:.3f}"
    return f"{first[key]:.3f} -> {last[key]:.3f}"


def rise_in_se(first: dict, last: dict, key: str) -> float:
    """(final - base) over the standard error of that difference, the two ends' errors taken as independent: a
    conservative choice, since both ends evaluate the same prompts and their errors are positively correlated. Both
    errors are 0 only where both ends score 0 or 1 on every prompt: no move is 0, a move (0 -> 1) +-inf."""
    rise, se = last[key] - first[key], (first[key + "_se"] ** 2 + last[key + "_se"] ** 2) ** 0.5
    return rise / se if se > 0 else math.copysign(math.inf, rise) if rise else 0.0


def command(args: Args) -> str:
    """The command that writes this table: the runs, the budget, and each other flag not at its default."""
    return f"`{runner_command('repro/real_model_recipe.py', args, always=('runs', 'steps', 'eval_every', 'eval_prompts'))}`"


def by_turn(rows: list[dict]) -> str:
    """Clip fraction (mean over the n steps that had a model turn k, ± its se over those steps) and ratio spread (median)
    at each model turn k: the embedded chain tasks' table by position (repro/README.md, "Multi-turn: the chain task");
    then turn k's ratio spread less turn k + 1's, paired by step (mean ± se over the steps that had both)."""
    def mean_se(values: list[float], scale: float = 1.0, digits: int = 4) -> str:
        se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
        return f"{scale * statistics.mean(values):.{digits}f} ± {scale * se:.{digits}f}"

    turns = max((int(key.rsplit("_t", 1)[1]) for r in rows for key in r if key.startswith("turns/clip_frac_t")), default=0)
    cells, pairs = [], []
    for k in range(1, turns + 1):
        clip = [r[f"turns/clip_frac_t{k}"] for r in rows if f"turns/clip_frac_t{k}" in r]
        spread = statistics.median(r[f"turns/ratio_std_t{k}"] for r in rows if f"turns/ratio_std_t{k}" in r)
        cells.append(f"turn {k}: {mean_se(clip, 100, 2)} % / {spread:.4f} (n = {len(clip)})")
        both = [r[f"turns/ratio_std_t{k - 1}"] - r[f"turns/ratio_std_t{k}"] for r in rows
                if f"turns/ratio_std_t{k}" in r and f"turns/ratio_std_t{k - 1}" in r]
        if len(both) > 1:
            pairs.append(f"turn {k - 1} - turn {k}: {mean_se(both)} (n = {len(both)}, {sum(d > 0 for d in both)} above 0)")
    return "; ".join(cells) + (". Ratio spread, paired by step: " + "; ".join(pairs) if pairs else "")


def main(args: Args) -> None:
    plan = []
    for run in args.runs:
        recipe, _, seed = run.partition(":")
        if recipe not in RECIPES or not seed.isdigit():
            raise SystemExit(f"--runs {run!r}: expected recipe:seed, the recipe one of {', '.join(RECIPES)}")
        plan.append((recipe, int(seed)))
    jobs = [Job(f"{recipe}_s{seed}", "grpo.py", [*with_recipe(flags(args), RECIPES[recipe]), "--seed", str(seed)])
            for recipe, seed in plan]
    runs = run_jobs(jobs, args.output_dir, workers=1)
    keys = [("pass@1", "pass@1"), ("pass@k", "pass@4"), ("greedy", "greedy"), ("format_rate", "format"),
            ("mean_length", "length")]
    lines = [command(args), "",
             "| recipe | seed | set | " + " | ".join(f"{label}: base -> final" for _, label in keys) +
             " | rise in se: pass@1, greedy | steps with a gradient | cut at the budget | wall time (s) | peak memory (MB) |",
             "|---" * (len(keys) + 8) + "|"]
    for (recipe, seed), job in zip(plan, jobs):
        run = runs[job.name]
        first, last = evals(run["rows"])[0], evals(run["rows"])[-1]
        trained = [r for r in run["rows"] if "policy/grad_norm" in r]
        moved = sum(r["frac_reward_zero_std"] < 1 for r in trained)
        cut = sum(r["completions/clipped_frac"] for r in trained) / len(trained)
        for prefix, name in [(prefix, name) for prefix, name in SETS if prefix + "pass@1" in last]:
            cells = " | ".join(cell(first, last, prefix + k) for k, _ in keys)
            rise = f"{rise_in_se(first, last, prefix + 'pass@1'):.1f}, {rise_in_se(first, last, prefix + 'greedy'):.1f}"
            lines.append(f"| {recipe} | {seed} | {name} | {cells} | {rise} | {moved} of {len(trained)} | {100 * cut:.0f} % | "
                         f"{run['wall_s']:.0f} | {run['peak_rss_mb']:.0f} |")
    lines += ["", "pass@1 by evaluated step (held-out / transfer):", ""]
    for job in jobs:
        lines.append(f"- {job.name}: " + ", ".join(f"{r['step']}: {r['eval/pass@1']:.3f} / {r['eval/transfer/pass@1']:.3f}"
                                                   for r in evals(runs[job.name]["rows"])))
    turned = [job for job in jobs if any("turns/clip_frac_t1" in r for r in runs[job.name]["rows"])]
    if turned:
        lines += ["", "Multi-turn runs, clip fraction by model turn (mean over the steps that had one, ± se) / ratio "
                  "spread (median over steps), over every pass's tokens (a first pass's ratio is 1, never clipped: "
                  "at one pass a batch both are 0 by construction):", ""]
        lines += [f"- {job.name}: {by_turn(runs[job.name]['rows'])}" for job in turned]
    out = save_table(args.name, "\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for i, job in enumerate(jobs):
        e = evals(runs[job.name]["rows"])
        steps = [r["step"] for r in e]
        for ax, (prefix, name) in zip(axes, SETS[:2]):  # held-out (multi-turn for turns_lr1e-5) and transfer
            ax.errorbar(steps, [r[prefix + "pass@1"] for r in e], yerr=[r[prefix + "pass@1_se"] for r in e], fmt="o-",
                        color=f"C{i}", label=job.name, capsize=2)
            ax.set(xlabel="step", ylabel=f"{name} pass@1 (± se)")
        axes[2].plot(steps, [r["eval/format_rate"] for r in e], "s--", color=f"C{i}", label=job.name)
    axes[2].set(xlabel="step", ylabel="held-out format rate", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
