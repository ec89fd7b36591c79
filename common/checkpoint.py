"""Checkpoints that survive a crash or Ctrl-C, and a graceful stop on SIGINT/SIGTERM.

A checkpoint is <run_dir>/checkpoints/step_000050/: the policy and tokenizer in save_pretrained
form (loadable by any transformers user) plus state.pt (optimizer, step, RNG states, extras). It is
written into a temporary directory and renamed into place, so a checkpoint directory that exists
is complete; the older ones are deleted only after the new one is in place.
"""

from __future__ import annotations

import pickle
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
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "extra": extra or {}}, tmp / "state.pt")
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
        found = [p]
    else:
        found = sorted(c for c in (p / "checkpoints").glob("step_*") if c.suffix != ".tmp" and (c / "state.pt").is_file())
    if not found:
        raise ConfigError(f"--resume {path}: no checkpoint there (expected <run dir>/checkpoints/step_*/state.pt)")
    read_state(found[-1], mmap=True)  # refused now, before any model is built, if it is not plain data
    return found[-1]


def rng_state() -> dict:
    """The Python, numpy and torch RNG states as tensors and plain values (what torch.load(weights_only=True) reads)."""
    numpy = np.random.get_state(legacy=False)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "numpy": {**numpy, "state": {"key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
                                        "pos": numpy["state"]["pos"]}}}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def set_rng_state(rng: dict) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = rng["numpy"]
    np.random.set_state({**numpy, "state": {"key": numpy["state"]["key"].numpy().astype(np.uint32), "pos": numpy["state"]["pos"]}})
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def read_state(checkpoint: Path, mmap: bool = False) -> dict:
    """state.pt read with weights_only=True: tensors and plain values only. A pickle of anything else (which a shared
    checkpoint could use to run code while it is unpickled) is refused, unexecuted."""
    path = Path(checkpoint) / "state.pt"
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--resume {checkpoint}: {path} holds objects other than tensors and plain values, refused without "
                          f"running them ({first}); a postrl checkpoint holds none") from None


def load_state(checkpoint: Path, optimizer) -> dict:
    """Restore the optimizer and RNG states; returns the saved dict (step, extra)."""
    state = read_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
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
