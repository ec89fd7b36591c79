"""Reproduce the README's GRPO results on the embedded jobs: default flags, 3 seeds, both tasks.

    python repro/grpo_embedded.py                 # ~10 minutes on 2 CPU cores
    python repro/grpo_embedded.py --seeds 0 --tasks reverse

Runs `python grpo.py --task T --seed S` one after another (so wall times are not shared), then
writes repro/results/grpo_embedded.md (table and curve) and, if matplotlib is installed,
repro/results/grpo_embedded.png.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.logging import read_metrics  # noqa: E402


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """seeds to run"""
    tasks: list[str] = field(default_factory=lambda: ["reverse", "add"])
    """embedded tasks to run"""
    output_dir: str = "runs/repro_grpo_embedded"
    """where the runs go"""
    results: str = "repro/results"
    """where the table and figure go"""


def main(args: Args) -> None:
    curves: dict[str, list] = {}
    lines = ["| task | seed | base pass@1 | final pass@1 | final pass@8 | final greedy | wall time (s) |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for task in args.tasks:
        for seed in args.seeds:
            name = f"{task}_s{seed}"
            t0 = time.time()
            subprocess.run([sys.executable, "grpo.py", "--task", task, "--seed", str(seed), "--output-dir",
                            args.output_dir, "--run-name", name], cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
            wall = time.time() - t0
            rows = [r for r in read_metrics(ROOT / args.output_dir / name) if "eval/pass@1" in r]
            curves[name] = [(r["step"], r["eval/pass@1"]) for r in rows]
            base, final = rows[0], rows[-1]
            summary.setdefault(task, []).append((base["eval/pass@1"], final["eval/pass@1"], wall))
            lines.append(f"| {task} | {seed} | {base['eval/pass@1']:.3f} | {final['eval/pass@1']:.3f} | "
                         f"{final['eval/pass@k']:.3f} | {final['eval/greedy']:.3f} | {wall:.0f} |")
            print(lines[-1], flush=True)
    for task, runs in summary.items():
        b, f, w = (statistics.mean(x) for x in zip(*runs))
        lines.append(f"| {task} | mean | {b:.3f} | {f:.3f} | | | {w:.0f} |")
    lines += ["", "eval/pass@1 by step (seed 0):", ""]
    for task in args.tasks:
        curve = curves.get(f"{task}_s{args.seeds[0]}", [])
        lines.append(f"- {task}: " + ", ".join(f"{s}: {p:.2f}" for s, p in curve))
    out = ROOT / args.results
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpo_embedded.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no figure")
        return
    fig, axes = plt.subplots(1, len(args.tasks), figsize=(5 * len(args.tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], args.tasks):
        for seed in args.seeds:
            steps, values = zip(*curves[f"{task}_s{seed}"])
            ax.plot(steps, values, label=f"seed {seed}")
        ax.set(title=f"grpo.py --task {task}", xlabel="step", ylabel="eval/pass@1", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grpo_embedded.png", dpi=120)


if __name__ == "__main__":
    main(tyro.cli(Args))
