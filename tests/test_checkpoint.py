"""Checkpoints and stops: a non-finite loss or gradient never reaches the weights, a checkpoint is data and never
code, the last two checkpoints are kept, and a run resumes from any one of them."""

import sys

import pytest
import torch
from conftest import latest_weights, small_args, state_dicts_equal, without_timing

import async_grpo
import gapo
import grpo
import is_grpo
import ppo
from common.cli import ConfigError, NonFiniteError, run
from common.logging import read_metrics

LOSS_FUNCTION = {grpo: "grpo_loss", gapo: "gapo_loss", is_grpo: "grpo_loss", ppo: "ppo_loss", async_grpo: "async_loss"}
PPO_SMALL = dict(prompts_per_step=16, num_generations=1, minibatches=2, ppo_epochs=2)


def poison_after_first_checkpoint(script, monkeypatch, kind: str) -> None:
    """From the first checkpoint on (step 1's, with --save-every 1), the script's loss is NaN ("loss"), or finite with a
    NaN gradient ("gradient": torch.where sends 0 * NaN = NaN back through the branch it did not take)."""
    poisoned, save, loss_fn = [], script.save_checkpoint, getattr(script, LOSS_FUNCTION[script])

    def save_then_poison(*args, **kwargs):
        poisoned.append(True)
        return save(*args, **kwargs)

    def loss(logps, *args, **kwargs):
        value, stats = loss_fn(logps, *args, **kwargs)
        if poisoned and kind == "loss":
            value = value * float("nan")
        elif poisoned:
            value = torch.where(torch.tensor(True), value, torch.sqrt(-(logps.sum().abs() + 1)))
        return value, stats

    monkeypatch.setattr(script, "save_checkpoint", save_then_poison)
    monkeypatch.setattr(script, LOSS_FUNCTION[script], loss)


@pytest.mark.parametrize("script, kind", [(grpo, "loss"), (grpo, "gradient"), (gapo, "loss"), (is_grpo, "loss"),
                                          (ppo, "gradient"), (async_grpo, "loss")],
                         ids=lambda x: getattr(x, "__name__", x))
def test_a_non_finite_loss_or_gradient_stops_the_run_before_the_weights_change(tmp_path, monkeypatch, script, kind):
    poison_after_first_checkpoint(script, monkeypatch, kind)
    before = torch.nn.utils.parameters_to_vector
    metric = "loss is nan" if kind == "loss" else "policy/grad_norm is nan"
    with pytest.raises(NonFiniteError, match=f"^step 2: {metric} before the optimiser step; the weights were not updated"):
        script.main(small_args(script, tmp_path, steps=4, save_every=1, eval_every=0, **(PPO_SMALL if script is ppo else {})))
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_000001"]  # the last checkpoint is step 1's, intact
    assert torch.isfinite(before(latest_weights(tmp_path / "run").parameters())).all()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


def test_the_error_is_one_line_with_exit_status_1(capsys):
    def main(_):
        raise NonFiniteError("step 7: loss is nan before the optimiser step")

    with pytest.raises(SystemExit) as exit_:
        run(main, None)
    assert exit_.value.code == 1
    assert capsys.readouterr().err.strip().endswith("error: step 7: loss is nan before the optimiser step")


class RunsCode:
    """What a crafted state.pt can hold: unpickling it calls exec, which here leaves a file behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path, monkeypatch):
    grpo.main(small_args(grpo, tmp_path, steps=1, eval_every=0))
    state = tmp_path / "run" / "checkpoints" / "step_000001" / "state.pt"
    marker = tmp_path / "ran"
    torch.save({"step": 1, "optimizer": {}, "rng": RunsCode(marker), "extra": {}}, state)
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match="state.pt holds objects other than tensors and plain values, refused without running"):
        grpo.main(small_args(grpo, tmp_path, steps=2, eval_every=0, resume=str(tmp_path / "run")))
    assert not marker.exists()


def test_the_last_two_checkpoints_are_kept_and_a_run_resumes_from_a_checkpoint_directory(tmp_path):
    grpo.main(small_args(grpo, tmp_path, steps=4, save_every=1, eval_every=2))
    run_dir = tmp_path / "run"
    assert [c.name for c in sorted((run_dir / "checkpoints").glob("step_*"))] == ["step_000003", "step_000004"]
    metrics, weights = read_metrics(run_dir), latest_weights(run_dir)
    grpo.main(small_args(grpo, tmp_path, steps=4, save_every=1, eval_every=2, resume=str(run_dir / "checkpoints" / "step_000003")))
    assert without_timing(read_metrics(run_dir)) == without_timing(metrics)  # step 4 again, the same numbers
    assert state_dicts_equal(latest_weights(run_dir), weights)


def test_gapo_resumes_like_an_uninterrupted_run(tmp_path):
    gapo.main(small_args(gapo, tmp_path / "full", steps=4, save_every=2))
    gapo.main(small_args(gapo, tmp_path / "cut", steps=2, save_every=2))
    gapo.main(small_args(gapo, tmp_path / "cut", steps=4, save_every=2, resume=str(tmp_path / "cut" / "run")))
    assert without_timing(read_metrics(tmp_path / "cut" / "run")) == without_timing(read_metrics(tmp_path / "full" / "run"))
    assert state_dicts_equal(latest_weights(tmp_path / "cut" / "run"), latest_weights(tmp_path / "full" / "run"))


@pytest.mark.parametrize("ends", ["returns", "exits"])
def test_a_script_leaves_no_process_group_behind_whichever_way_it_ends(tmp_path, ends):
    """run() destroys the distributed process group a script's Accelerator made: a gloo group left to the interpreter's
    exit could abort a process that had finished its run ("terminate called without an active exception", seen in
    one of several two-process runs of tests/test_grpo.py)."""
    import torch.distributed as dist

    def main(_):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        if ends == "exits":
            sys.exit(130)  # a stop request: checkpointed, then exit status 130

    try:
        run(main, None)
    except SystemExit:
        pass
    assert not dist.is_initialized()
