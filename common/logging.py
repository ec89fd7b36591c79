"""One metrics writer for every script: runs/<run_name>/metrics.jsonl always (one JSON object per
logged step, with `step`), TensorBoard when it is installed, Weights & Biases with --track."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm


def device_memory(device) -> dict[str, float]:
    """memory/max_allocated_mb: the most GPU memory torch has held so far on a CUDA device (nothing elsewhere;
    on a CPU, measure the process's peak resident memory from outside)."""
    if torch.device(device).type != "cuda":
        return {}
    return {"memory/max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}


class MetricsWriter:
    def __init__(self, run_dir: Path, args, track: bool = False, project: str = "postrl", resume_step: int = -1):
        """Writes args.json; on resume keeps only the metrics of steps <= resume_step."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args)
        (self.run_dir / "args.json").write_text(json.dumps(config, indent=2) + "\n")
        self.path = self.run_dir / "metrics.jsonl"
        if self.path.exists():  # resume: drop what was logged after the checkpoint
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.run_dir))
        except ImportError:
            pass
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(project=project, name=self.run_dir.name, config=config, dir=str(self.run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def histogram(self, step: int, key: str, values) -> None:
        """A distribution (TensorBoard and wandb only; metrics.jsonl keeps scalars)."""
        if self.tensorboard is not None:
            self.tensorboard.add_histogram(key, np.asarray(list(values), dtype=np.float64), step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({key: wandb.Histogram(list(values))}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def print_summary(run_dir: str | Path, steps: int, k: int) -> None:
    """The evaluation of the base policy (step 0) and of the last step, a line each (pass@k only when k > 1)."""
    for row in read_metrics(run_dir):
        if row["step"] in (0, steps):
            pass_k = f"  eval/pass@{k} {row['eval/pass@k']:.3f}" if k > 1 else ""
            print(f"step {row['step']:4d}  eval/pass@1 {row['eval/pass@1']:.3f}{pass_k}  eval/greedy {row['eval/greedy']:.3f}")


def progress_bar(total: int, initial: int = 0, disable: bool = False, desc: str = "") -> tqdm:
    return tqdm(total=total, initial=initial, disable=disable, desc=desc, dynamic_ncols=True)
