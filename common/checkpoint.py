"""Checkpoints that survive a crash or Ctrl-C, and a graceful stop on SIGINT/SIGTERM.

A checkpoint is <run_dir>/checkpoints/step_000050/: the policy and tokenizer in save_pretrained
form (loadable by any transformers user) plus state.pt (optimizer, step, RNG states, extras). It is
written into a temporary directory and renamed into place, so a checkpoint directory that exists
is complete; the older ones are deleted only after the new one is in place.
"""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from common.cli import ConfigError


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, extra: dict | None = None, keep: int = 2,
                    weights: dict | None = None) -> Path:
    """weights: the model's full state dict when it is sharded (accelerator.get_state_dict gathers it under FSDP)."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng, "extra": extra or {}}, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(p for p in root.glob("step_*") if p.suffix != ".tmp")[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def export_model(run_dir: Path, model, tokenizer, dtype: str) -> Path:
    """The final policy cast to `dtype` (say bfloat16, for serving) in <run_dir>/export, written like a
    checkpoint (temporary directory, then renamed); a LoRA policy is merged into its base first. Checkpoints themselves keep the float32 weights, so
    that a resumed run continues exactly; this is a copy for use, not for resuming."""
    from common.models import DTYPES

    final, tmp = Path(run_dir) / "export", Path(run_dir) / "export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(model, "merge_and_unload"):  # LoRA: W + (alpha / r) B A folded into the weights, a plain model
        model = model.merge_and_unload()
    model.to(DTYPES[dtype]).save_pretrained(tmp)  # the run is over: casting in place saves a copy's memory
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def find_checkpoint(path: str, accelerator=None) -> Path:
    """A checkpoint directory, or the latest complete checkpoint of a run directory. Under FSDP the optimizer
    state is sharded over the processes and a checkpoint holds the gathered weights only: resuming is refused."""
    if accelerator is not None and accelerator.distributed_type == "FSDP":
        raise ConfigError(f"--resume {path}: resuming an FSDP run is not supported (its AdamW state is sharded); a checkpoint "
                          "holds the full weights, so start a new run from it with --model <checkpoint dir>")
    p = Path(path)
    if (p / "state.pt").is_file():
        return p
    found = sorted(c for c in (p / "checkpoints").glob("step_*") if c.suffix != ".tmp" and (c / "state.pt").is_file())
    if not found:
        raise ConfigError(f"--resume {path}: no checkpoint there (expected <run dir>/checkpoints/step_*/state.pt)")
    return found[-1]


def load_state(checkpoint: Path, optimizer) -> dict:
    """Restore the optimizer and RNG states; returns the saved dict (step, extra)."""
    state = torch.load(Path(checkpoint) / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state


def run_dir_of(checkpoint: Path) -> Path:
    return Path(checkpoint).parent.parent


class GracefulStop:
    """The first SIGINT (Ctrl-C) or SIGTERM asks the loop to stop after the current step (it then
    checkpoints and exits non-zero); a second one interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
              "(send it again to stop at once)", flush=True)

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
