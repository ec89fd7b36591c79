"""Where the real-model recipe's accuracy comes from, problem by problem, and why it does not transfer.

    python repro/real_model_why.py        # the base model and the three seeds' final checkpoints: ~25 min on 2 cores

For the base model and each --runs checkpoint, on the first --problems of both held-out sets (the training
generator's test split, the independent transfer set): --samples completions per problem at T 0.7 and one
greedy, at most 128 new tokens, every model drawing the same uniforms (the evaluation's keys with seed 0: a
paired comparison; the runs' own evaluations use their seed's keys, so their numbers differ by sampling noise).
Problems are grouped by the number of steps of their reference solution (one line each) and by the operations
in them. Per group: pass@1, greedy, format rate (`#### N`), the share cut at the budget, and how far a sampled
completion gets through the reference's steps (step i is reached when the completion writes the reference's
i-th intermediate result, and every step before it is: where the chain breaks; a result that is also a number
of the question counts as written). From each run's training log: the share of groups with a
reward signal, of completions cut, and the two reward parts, in the first and last ten steps. With --multi-turn, the
held-out problems are also asked one step a turn, as a gsm8k-turns run is trained and evaluated (the set "held-out,
multi-turn": a problem is right if its final turn is, its format and steps are read off the model's turns, and it is
cut if any turn ran to the budget). Writes repro/results/<name>.md.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro
from real_model_recipe import DATA, data as word_problems_data
from runner import ROOT, command as runner_command, save_table

from common.logging import read_metrics
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.rollout import eval_rollouts
from common.tasks import load_task, read_rows
from common.word_problems import solution_steps

RECIPE_RUNS = ROOT / "runs" / "repro_real_model_recipe"


@dataclass
class Args:
    runs: list[str] = field(default_factory=lambda: [f"shaped_lr1e-5_s{s}" for s in range(3)])
    """run names under runs/repro_real_model_recipe; each one's last checkpoint is evaluated"""
    problems: int = 100
    samples: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.7
    multi_turn: bool = False
    """also ask the held-out problems one step a turn (--task gsm8k-turns' environment), the budget a turn"""
    name: str = "real_model_why"


def numbers_in(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text.replace(",", ""))}


def evaluation_sets(args: Args, data: Path = DATA) -> tuple[dict, dict]:
    """{set: (task, its rows as the task serves them)} and {set: the raw rows, with their worked solutions}: the first
    --problems of the held-out and transfer files, as the runs evaluate them, and with --multi-turn the held-out rows
    again as gsm8k-turns serves them."""
    files = {"held-out": data / "test.jsonl", "transfer": data / "transfer.jsonl"}
    task = load_task("gsm8k", str(data / "train.jsonl"), str(files["held-out"]), args.problems,
                     extra_eval_paths=[str(files["transfer"])])
    sets = {"held-out": (task, task.test), "transfer": (task, task.extra_tests["transfer"])}
    raw = {name: read_rows(str(file))[: args.problems] for name, file in files.items()}
    if args.multi_turn:
        turns = load_task("gsm8k-turns", str(data / "train.jsonl"), str(files["held-out"]), args.problems)
        sets["held-out, multi-turn"], raw["held-out, multi-turn"] = (turns, turns.test), raw["held-out"]
    return sets, raw


def score_model(path: str, sets: dict, raw: dict, args: Args) -> dict:
    """{set: [per problem {correct: [bool] * samples, greedy, formatted, cut, reached: steps reached per sample}]}"""
    tokenizer = load_tokenizer(path)
    model = load_model(path).eval()
    out, n, eos = {}, args.samples, eos_token_ids(model, tokenizer)
    for name, (task, data) in sets.items():
        sampled, _, correct, greedy_correct = eval_rollouts(
            model, tokenizer, task, data, list(range(len(data))), n, args.max_new_tokens, args.temperature,
            eos, torch.device("cpu"), seed=0)
        formatted, cut = task.formatted_rows(sampled), (~sampled.finished).tolist()
        texts = sampled.texts if sampled.turn_texts is None else [" ".join(turns) for turns in sampled.turn_texts]
        out[name] = []
        for i, row in enumerate(raw[name]):
            steps = [(op, result) for _, op, _, result in solution_steps(row["answer"])]
            reached = []
            for text in texts[i * n : (i + 1) * n]:  # the number of leading reference steps whose result it writes
                found = numbers_in(text)
                reached.append(next((k for k, (_, value) in enumerate(steps) if value not in found), len(steps)))
            out[name].append({"steps": len(steps), "ops": " ".join(op for op, _ in steps),
                              "correct": correct[i * n : (i + 1) * n], "formatted": formatted[i * n : (i + 1) * n],
                              "cut": cut[i * n : (i + 1) * n], "greedy": greedy_correct[i], "reached": reached})
    return out


def summary(problems: list[dict]) -> dict:
    def mean(key):
        return statistics.mean(x for p in problems for x in (p[key] if isinstance(p[key], list) else [p[key]]))

    return {"n": len(problems), "pass@1": mean("correct"), "greedy": mean("greedy"), "format": mean("formatted"),
            "cut": mean("cut"), "reached": statistics.mean(r / p["steps"] for p in problems for r in p["reached"])}


def training_log(run: str, rows: list[dict]) -> str:
    """The run's row of the training table, from its metrics rows. A multi-turn run (gsm8k-turns) logs no reward parts:
    its accuracy is the share of trajectories whose final answer is right (accuracy/train), its format '–'."""
    rows = [r for r in rows if "policy/grad_norm" in r]

    def avg(part, key):
        return statistics.mean(r[key] for r in part)

    first, last = rows[:10], rows[-10:]
    accuracy = "reward/gsm8k_reward" if "reward/gsm8k_reward" in rows[0] else "accuracy/train"
    fmt = (f"{avg(first, 'reward/gsm8k_format_reward'):.2f} -> {avg(last, 'reward/gsm8k_format_reward'):.2f}"
           if "reward/gsm8k_format_reward" in rows[0] else "–")
    return (f"| {run} | {1 - avg(first, 'frac_reward_zero_std'):.2f} -> {1 - avg(last, 'frac_reward_zero_std'):.2f} | "
            f"{avg(first, 'completions/clipped_frac'):.2f} -> {avg(last, 'completions/clipped_frac'):.2f} | "
            f"{avg(first, accuracy):.3f} -> {avg(last, accuracy):.3f} | {fmt} |")


def last_checkpoint(run: str) -> str:
    checkpoints = sorted((RECIPE_RUNS / run / "checkpoints").glob("step_*"))
    if not checkpoints:
        raise SystemExit(f"--runs {run}: no checkpoint under {RECIPE_RUNS / run} (run repro/real_model_recipe.py first)")
    return str(checkpoints[-1])


def command(args: Args) -> str:
    """The command that writes this table (its first line): --runs, --problems, --samples, and each flag not at its default."""
    return runner_command("repro/real_model_why.py", args, always=("runs", "problems", "samples"))


def main(args: Args) -> None:
    paths = {"base": resolve_model("smollm2-135m-instruct", "gsm8k"), **{run: last_checkpoint(run) for run in args.runs}}
    sets, raw = evaluation_sets(args, word_problems_data())
    results = {model: score_model(path, sets, raw, args) for model, path in paths.items()}
    trained = list(args.runs)
    lines = [f"`{command(args)}`",
             "", f"By the number of steps of the reference solution (base -> mean of the {len(trained)} trained checkpoints; "
             "'steps reached': the share of the reference's steps whose results a sampled completion writes, in order):", "",
             "| set | steps | problems | pass@1 | greedy | format | cut at 128 | steps reached |", "|---" * 8 + "|"]

    def row(label: str, steps: str, select) -> str:
        base = summary([p for p in results["base"][label] if select(p)])
        runs = [summary([p for p in results[r][label] if select(p)]) for r in trained]
        cells = [f"{base[k]:.{2 if k != 'pass@1' else 3}f} -> {statistics.mean(s[k] for s in runs):.{2 if k != 'pass@1' else 3}f}"
                 for k in ("pass@1", "greedy", "format", "cut", "reached")]
        return f"| {label} | {steps} | {base['n']} | " + " | ".join(cells) + " |"

    for label in raw:
        for k in sorted({p["steps"] for p in results["base"][label]}):
            lines.append(row(label, str(k), lambda p, k=k: p["steps"] == k))
        lines.append(row(label, "all", lambda p: True))
    lines += ["", "By the operations of the reference solution (problems; pass@1 base -> trained):", "",
              "| set | operations | problems | pass@1 | greedy |", "|---" * 5 + "|"]
    for label in raw:
        for ops in sorted({p["ops"] for p in results["base"][label]}, key=lambda o: (len(o), o)):
            base = summary([p for p in results["base"][label] if p["ops"] == ops])
            runs = [summary([p for p in results[r][label] if p["ops"] == ops]) for r in trained]
            lines.append(f"| {label} | {ops} | {base['n']} | {base['pass@1']:.3f} -> {statistics.mean(s['pass@1'] for s in runs):.3f} "
                         f"| {base['greedy']:.2f} -> {statistics.mean(s['greedy'] for s in runs):.2f} |")
    lines += ["", "Training (first 10 -> last 10 steps): groups with a reward signal, completions cut at the budget, "
              "accuracy reward, format reward:", "", "| run | groups with signal | cut | accuracy reward | format reward |",
              "|---" * 5 + "|", *[training_log(run, read_metrics(RECIPE_RUNS / run)) for run in trained]]
    right = {m: [ok for label in raw for p in results[m][label] for ok, f in zip(p["correct"], p["formatted"]) if f]
             for m in paths}
    lines += ["", "Formatted completions that are right: " + ", ".join(
        f"{m} {sum(v) / max(len(v), 1):.3f} of {len(v)}" for m, v in right.items())]
    save_table(args.name, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
