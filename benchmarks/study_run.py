"""A real-model study run before and after issue 32's speed-ups: wall time by phase against each phase's floor, and
the figures of both.

    git worktree add /tmp/before 7af4fda          # the code before
    python benchmarks/study_run.py --baseline /tmp/before     # ~75 minutes on 2 CPU cores

The staleness study's recipe run (repro/real_model_staleness.py's K0 arm: grpo.py on SmolLM2-135M-Instruct, float32,
4 prompts x 8 completions, 128 new tokens, T 0.7, shaped reward, lr 1e-5; held-out and transfer evaluation of 100
problems x 4 samples and a greedy pass at steps 0, 20 and 40), one arm after the other in --arms order: `cold` starts
this checkout's grpo.py with --eval-cache on an empty cache and stops it once its step-0 evaluation is logged (the
base model's evaluation, computed and kept); `before` runs the --baseline checkout's grpo.py; `after` this
checkout's, with the cache `cold` filled: the run of every arm of a study but the first, which finds the base
model's evaluation there. The first arm of a study pays `cold`'s evaluation instead of `after`'s step-0 load.
Each arm is its own process (os.wait4: its peak RSS); an arm whose run finished is read, not run again.

Phases: sampling and training are the logged time/rollout_s and time/train_s summed over steps; evaluation and
start-up is the rest of the wall time (the code before logs no evaluation time); `after` also logs time/eval_s.
Floors (benchmarks/real_model_steps.py's Floors, rate and bandwidth measured here after the runs): training, 3x
the forward arithmetic of each step's batch (each group's prompt once); sampling, each prompt's arithmetic and,
per decode step, every weight and the running rows' caches read once; every row taken at its batch's logged mean
length and every prompt at the data's mean tokenized length. Writes benchmarks/results/study_run.md.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "repro"))
from real_model_recipe import RECIPES, Args as RecipeArgs, flags as recipe_flags  # noqa: E402
from real_model_steps import Floors, matmul_rate, read_bandwidth  # noqa: E402


@dataclass
class Args:
    baseline: str | None = None
    """a checkout of the code before (its grpo.py runs the `before` arm); needed unless that run has finished"""
    arms: list[str] = field(default_factory=lambda: ["cold", "before", "after"])
    seed: int = 2
    steps: int = 40
    eval_every: int = 20
    eval_prompts: int = 100
    output_dir: str = "runs/bench_study_run"
    reference_cache: str | None = None
    """an evaluation cache of the same run made by other code (the same weights, prompts and draws): the step-0
    completions of both are compared token by token (how many draws flipped)"""


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if run_dir.is_dir() else []


def grpo_flags(args: Args) -> list[str]:
    """grpo.py's flags of every arm: the recipe study's shaped_lr1e-5 run of --seed (repro/real_model_recipe.py)."""
    base = recipe_flags(RecipeArgs(steps=args.steps, eval_every=args.eval_every, eval_prompts=args.eval_prompts))
    return [*base, *RECIPES["shaped_lr1e-5"], "--seed", str(args.seed)]


def run(arm: str, args: Args) -> dict:
    """Run one arm in its own process (unless it finished); its metrics rows, wall time and peak RSS."""
    out = ROOT / args.output_dir
    run_dir, done = out / arm, out / arm / "done.json"
    if done.exists():
        return {**json.loads(done.read_text()), "rows": read(run_dir)}
    flags = [*grpo_flags(args), "--output-dir", str(out), "--run-name", arm]
    if arm == "before" and args.baseline is None:
        raise SystemExit("--baseline: a checkout of the code before is needed for the `before` arm")
    cwd = Path(args.baseline).resolve() if arm == "before" else ROOT
    if arm == "cold" and (out / "eval_cache").exists():
        raise SystemExit(f"`cold` needs an empty cache: remove {out / 'eval_cache'} first")
    if arm != "before":
        flags += ["--eval-cache", str(out / "eval_cache")]
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "grpo.py", *flags], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while arm == "cold" and proc.poll() is None and not read(run_dir):  # stopped once step 0 is logged
        time.sleep(1)
    if arm == "cold" and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0 and arm != "cold":
        raise RuntimeError(f"{arm}: grpo.py {' '.join(flags)} exited with status {status}")
    result = {"wall_s": time.time() - t0, "peak_rss_mb": usage.ru_maxrss / 1024}
    done.write_text(json.dumps(result) + "\n")
    print(f"  {arm}: {result['wall_s']:.0f} s", flush=True)
    return {**result, "rows": read(run_dir)}


def floors(rows: list[dict], floor: Floors, prompt_len: int, eval_prompts: int, sets: int) -> dict[str, float]:
    """Seconds of arithmetic (and bytes) each phase needs, from the logged mean lengths."""
    train = sampling = evaluation = 0.0
    for r in rows:
        if "completions/mean_length" in r:  # 4 groups of 8 at the batch's mean length
            groups = [[round(r["completions/mean_length"])] * 8] * 4
            train += 3 * floor.forward([prompt_len] * 4, groups)
            sampling += floor.sampling([prompt_len] * 4, groups)
        for prefix in ("eval/", "eval/transfer/")[:sets]:
            if prefix + "mean_length" in r:  # 4 samples and a greedy pass of each prompt
                n = round(r[prefix + "mean_length"])
                evaluation += floor.sampling([prompt_len] * eval_prompts, [[n] * 4] * eval_prompts)
                evaluation += floor.sampling([prompt_len] * eval_prompts, [[n]] * eval_prompts)
    return {"sampling": sampling, "training": train, "evaluation": evaluation}


def flipped(reference: Path, cache: Path) -> str:
    """Of the base model's evaluation completions kept in two caches (each file: one set's sampled and greedy
    Rollouts): for each reference entry, the entry of the other cache with the same prompts and the fewest differing
    rows (the base model's, not a later step's: this cache holds the evaluations at steps 20 and 40 too), and how many
    of its completions differ in any token, sampled and greedy."""
    def entries(folder: Path) -> list:
        return [torch.load(f, weights_only=True) for f in sorted(folder.glob("*.pt"))]

    def differing(x: dict, y: dict) -> int:
        n = max(x["completion_ids"].shape[1], y["completion_ids"].shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[1]))  # noqa: E731
        return int(((pad(x["completion_ids"] * x["completion_mask"]) != pad(y["completion_ids"] * y["completion_mask"]))
                    | (pad(x["completion_mask"]) != pad(y["completion_mask"]))).any(-1).sum())

    counts = {"sampled": [0, 0], "greedy": [0, 0]}
    candidates = entries(cache)
    for a in entries(reference):
        same = [b for b in candidates if a[0]["prompt_ids"].shape == b[0]["prompt_ids"].shape
                and torch.equal(a[0]["prompt_ids"], b[0]["prompt_ids"])]
        if not same:
            continue
        b = min(same, key=lambda b: differing(a[0], b[0]) + differing(a[1], b[1]))
        for kind, x, y in (("sampled", a[0], b[0]), ("greedy", a[1], b[1])):
            counts[kind][0] += differing(x, y)
            counts[kind][1] += len(x["completion_ids"])
    return (f"Draws flipped: of the base model's evaluation completions (step 0, both sets), {counts['sampled'][0]} of "
            f"{counts['sampled'][1]} sampled and {counts['greedy'][0]} of {counts['greedy'][1]} greedy differ in some "
            f"token between {reference.relative_to(ROOT)} and {cache.relative_to(ROOT)}")


def main(args: Args) -> None:
    runs = {arm: run(arm, args) for arm in args.arms}
    from common.models import load_tokenizer, resolve_model
    from common.sampling import encode_prompts
    from common.tasks import load_task

    from transformers import AutoConfig

    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    config, tokenizer = AutoConfig.from_pretrained(path), load_tokenizer(path)
    data = ROOT / "data" / "word_problems"
    task = load_task("gsm8k", str(data / "train.jsonl"), str(data / "test.jsonl"))
    _, mask = encode_prompts(tokenizer, list(task.train["prompt"][:200]), "cpu")
    prompt_len = round(mask.sum(-1).float().mean().item())
    rate = matmul_rate("cpu", torch.float32, config.hidden_size, config.intermediate_size)
    bandwidth = read_bandwidth("cpu")
    floor = Floors(config, rate, bandwidth, 4)

    lines = [f"`python benchmarks/study_run.py --baseline /tmp/before --seed {args.seed} --steps {args.steps} --eval-every "
             f"{args.eval_every} --eval-prompts {args.eval_prompts}"
             + (f" --output-dir {args.output_dir}" if args.output_dir != Args.output_dir else "")
             + (f" --reference-cache {args.reference_cache}" if args.reference_cache else "")
             + f"`: SmolLM2-135M-Instruct, float32, 2 threads; "
             f"matrix products at {rate / 1e9:.0f} GFLOP/s, reads at {bandwidth / 1e9:.1f} GB/s (measured after the runs); "
             f"prompts of {prompt_len} tokens on average", "",
             "| arm | wall (s) | sampling (s) | training (s) | evaluation and start-up (s) | evaluations logged (s) | "
             "peak RSS (MB) | sampling floor (s) | training floor (s) | evaluation floor (s) |", "|---" * 10 + "|"]
    for arm in ("before", "after"):
        if arm not in runs:
            continue
        r = runs[arm]
        rows = [x for x in r["rows"] if x["step"] <= args.steps]
        sampling = sum(x.get("time/rollout_s", 0.0) for x in rows)
        training = sum(x.get("time/train_s", 0.0) for x in rows)
        logged = sum(x.get("time/eval_s", 0.0) for x in rows)
        f = floors(rows, floor, prompt_len, args.eval_prompts, 2)
        lines.append(f"| {arm} | {r['wall_s']:.0f} | {sampling:.0f} | {training:.0f} | {r['wall_s'] - sampling - training:.0f} | "
                     f"{logged:.0f} | {r['peak_rss_mb']:.0f} | {f['sampling']:.0f} | {f['training']:.0f} | {f['evaluation']:.0f} |")
    if {"before", "after"} <= runs.keys():
        before, after = runs["before"], runs["after"]
        hit = next(x for x in after["rows"] if x["step"] == 0)["time/eval_s"]
        lines += ["", f"after / before: {after['wall_s'] / before['wall_s']:.2f}x (every arm of a study but the first: "
                  f"the base model's evaluation loaded from the cache in {hit:.1f} s)"]
        if "cold" in runs and runs["cold"]["rows"]:
            cold = runs["cold"]["rows"][0]["time/eval_s"]
            first = after["wall_s"] - hit + cold
            lines[-1] += (f"; the first arm computes it ({cold:.0f} s, `cold`): {first:.0f} s in all, "
                          f"{first / before['wall_s']:.2f}x")
        lines += ["", "The figures (before / after):", "", "| step | held-out pass@1 | transfer pass@1 | greedy | transfer greedy "
                  "| format rate | mean length |", "|---" * 7 + "|"]
        for a in (x for x in before["rows"] if "eval/pass@1" in x):
            b = next(x for x in after["rows"] if x["step"] == a["step"])
            cells = [f"{a[k]:.3f} / {b[k]:.3f}" for k in ("eval/pass@1", "eval/transfer/pass@1", "eval/greedy",
                                                           "eval/transfer/greedy", "eval/format_rate")]
            lines.append(f"| {a['step']} | " + " | ".join(cells) + f" | {a['eval/mean_length']:.1f} / {b['eval/mean_length']:.1f} |")
        trained = {x["step"]: x for x in before["rows"] if "reward/mean" in x}
        differ = [x["step"] for x in after["rows"] if x["step"] in trained and any(
            x[k] != trained[x["step"]][k] for k in ("reward/mean", "completions/mean_length", "loss"))]
        lines += ["", "Training batches: " + (f"the logged rewards, lengths and losses are identical up to step {differ[0] - 1}"
                                               f" and differ from step {differ[0]} on" if differ else
                                               f"every step's logged reward, length and loss identical in both runs")]
    if args.reference_cache:
        lines += ["", flipped(ROOT / args.reference_cache, ROOT / args.output_dir / "eval_cache")]
    out = ROOT / "benchmarks" / "results" / "study_run.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
