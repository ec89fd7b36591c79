"""A short real-model run, before and after a change, alternating: wall time, and the step-0 evaluation's completions
compared (how many draws flipped).

    git worktree add /tmp/before 2fef09f
    python benchmarks/recipe_3step.py --baseline /tmp/before --rounds 2      # ~40 minutes on 2 CPU cores

The staleness study's recipe run (benchmarks/study_run.py's grpo_flags: grpo.py on SmolLM2-135M-Instruct, 4 prompts x
8 completions, 128 new tokens, T 0.7, shaped reward, lr 1e-5, seed 2, held-out and transfer evaluation of 100 problems x
4 samples and a greedy pass) for 3 steps, evaluated at steps 0 and 3. Each run is its own process with an evaluation
cache of its own, empty at the start (so every run computes its step-0 evaluation, and the cache keeps its completions
for the comparison); the arms alternate `before`, `after`, round after round. Writes benchmarks/results/recipe_3step.md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "repro"))
from runner import cpu_model, git  # noqa: E402
from study_run import Args as StudyArgs, flipped, grpo_flags, read  # noqa: E402


@dataclass
class Args:
    baseline: str
    """a checkout of the code before (its grpo.py runs the `before` arm)"""
    rounds: int = 2
    output_dir: str = "runs/bench_recipe_3step"
    name: str = "recipe_3step"


def run(arm: str, index: int, args: Args) -> dict:
    out = ROOT / args.output_dir / f"{arm}_r{index}"
    shutil.rmtree(out, ignore_errors=True)
    flags = [*grpo_flags(StudyArgs(steps=3, eval_every=3, eval_prompts=100)), "--output-dir", str(out), "--run-name", "run",
             "--eval-cache", str(out / "eval_cache")]
    cwd = Path(args.baseline).resolve() if arm == "before" else ROOT
    out.mkdir(parents=True)
    t0 = time.time()
    with open(out / "stderr.log", "w") as err:  # a file, not a pipe: a child's progress bars could fill a pipe unread
        proc = subprocess.Popen([sys.executable, "grpo.py", *flags], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{arm}: exited with status {status}: {(out / 'stderr.log').read_text()[-500:]}")
    result = {"arm": arm, "wall_s": time.time() - t0, "peak_rss_mb": usage.ru_maxrss / 1024, "rows": read(out / "run"),
              "dir": out}
    print(f"  {arm} round {index}: {result['wall_s']:.0f} s", flush=True)
    return result


def main(args: Args) -> None:
    runs = [run(arm, i, args) for i in range(args.rounds) for arm in ("before", "after")]
    wall = {arm: [r["wall_s"] for r in runs if r["arm"] == arm] for arm in ("before", "after")}
    first = {arm: next(r for r in runs if r["arm"] == arm) for arm in ("before", "after")}

    def evals(r) -> tuple[float, float]:
        return sum(x.get("time/eval_s", 0.0) for x in r["rows"]), sum(x.get("time/rollout_s", 0.0) + x.get("time/train_s", 0.0)
                                                                     for x in r["rows"])

    lines = [f"`python benchmarks/recipe_3step.py --baseline {args.baseline} --rounds {args.rounds}`: before = "
             f"{git('-C', str(Path(args.baseline).resolve()), 'rev-parse', '--short', 'HEAD')}, after = "
             f"{git('rev-parse', '--short', 'HEAD')}; SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads, "
             f"{cpu_model()}", "",
             "| arm | round | wall (s) | evaluations (s) | steps: sampling + training (s) | peak RSS (MB) | held-out pass@1 at 0, 3 |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        e, steps = evals(r)
        p = [x["eval/pass@1"] for x in r["rows"] if "eval/pass@1" in x]
        lines.append(f"| {r['arm']} | {i // 2} | {r['wall_s']:.0f} | {e:.0f} | {steps:.0f} | {r['peak_rss_mb']:.0f} | "
                     f"{', '.join(f'{v:.4f}' for v in p)} |")
    ratio = statistics.median(wall["after"]) / statistics.median(wall["before"])
    lines += ["", f"after / before (medians): {ratio:.2f}x", "",
              "Step-0 evaluation, first round's runs: " + flipped(first["before"]["dir"] / "eval_cache",
                                                                 first["after"]["dir"] / "eval_cache")]
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
