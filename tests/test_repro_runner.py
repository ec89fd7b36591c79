"""The reproductions' runner: a finished run is reused, a longer job extends a shorter finished run from its last
checkpoint, and a run stopped at a session's end is extended by the same command, each logging what an uninterrupted
run logs."""

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, SMALL, without_timing

sys.path.insert(0, str(ROOT / "repro"))
import runner  # noqa: E402
from runner import Job, run_jobs  # noqa: E402

FLAGS = [x for key, value in SMALL.items() for x in (f"--{key.replace('_', '-')}", str(value))]  # the tests' small run


def test_a_longer_job_extends_a_finished_shorter_run(tmp_path):
    short, long = Job("run", "grpo.py", [*FLAGS, "--steps", "2"]), Job("run", "grpo.py", [*FLAGS, "--steps", "4"])
    first = run_jobs([short], str(tmp_path / "extended"))["run"]
    again = run_jobs([short], str(tmp_path / "extended"))["run"]  # finished: not run again
    assert again["wall_s"] == first["wall_s"]
    never = Job("never", "grpo.py", FLAGS)  # start=False (--finished-only): the finished run read, no other started
    assert list(run_jobs([short, never], str(tmp_path / "extended"), start=False)) == ["run"]
    assert not (tmp_path / "extended" / "never").exists()
    assert run_jobs([long], str(tmp_path / "extended"), start=False) == {}  # nor a shorter finished run extended
    extended = run_jobs([long], str(tmp_path / "extended"))["run"]
    whole = run_jobs([long], str(tmp_path / "whole"))["run"]
    assert [r["step"] for r in extended["rows"] if "loss" in r] == [1, 2, 3, 4]
    assert without_timing(extended["rows"]) == without_timing(whole["rows"])
    done = json.loads((tmp_path / "extended" / "run" / "done.json").read_text())
    assert done["extended_from"] == 2 and done["wall_s"] > first["wall_s"]


def test_a_run_whose_log_was_kept_is_read_from_it_not_run_again(tmp_path, monkeypatch):
    """runs/ does not survive a fresh machine, repro/results/logs/ (in git) does: a finished run's kept log stands in."""
    monkeypatch.setattr(runner, "LOGS", tmp_path / "logs")
    job = Job("run", "grpo.py", [*FLAGS, "--steps", "2"])
    first = run_jobs([job], str(tmp_path / "study"))["run"]
    run_dir = tmp_path / "study" / "run"
    runner.keep_log(Job("run", "grpo.py", ["--model", "real"]), run_dir, str(tmp_path / "study"))  # as a real model's
    shutil.rmtree(run_dir)  # a fresh machine: the run directory is gone
    for start in (True, False):
        again = run_jobs([job], str(tmp_path / "study"), start=start)["run"]
        assert not run_dir.exists()  # not run again
        assert again["rows"] == first["rows"] and again["wall_s"] == first["wall_s"]
    longer = Job("run", "grpo.py", [*FLAGS, "--steps", "3"])  # no checkpoint to extend from: run whole
    assert [r["step"] for r in run_jobs([longer], str(tmp_path / "study"))["run"]["rows"] if "loss" in r] == [1, 2, 3]


def test_a_run_stopped_by_sigterm_is_extended_by_the_same_command(tmp_path):
    """A study spread over sessions: SIGTERM to the script (it finishes its step and checkpoints) stops the study with a
    message; the same command resumes the run from that checkpoint; the whole logs what an uninterrupted run logs."""
    job = Job("run", "grpo.py", [*FLAGS, "--steps", "30"])
    out, stopped = tmp_path / "stopped", {}

    def study():
        try:
            run_jobs([job], str(out))
        except SystemExit as exit:
            stopped["message"] = str(exit)

    thread = threading.Thread(target=study)
    thread.start()
    metrics = out / "run" / "metrics.jsonl"

    def trained_steps() -> int:
        return sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0

    while thread.is_alive() and trained_steps() < 2:
        time.sleep(0.05)
    subprocess.run(["pkill", "-TERM", "-f", f"output-dir {out} --run-name run"], check=True)
    thread.join()
    at = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 2 <= at < 30 and stopped["message"] == f"run: stopped at step {at} (checkpointed); the same command extends it"
    assert not (out / "run" / "done.json").exists() and run_jobs([job], str(out), start=False) == {}  # not finished
    piece = json.loads((out / "run" / "stopped.json").read_text())
    extended = run_jobs([job], str(out))["run"]
    whole = run_jobs([job], str(tmp_path / "whole"))["run"]
    assert [r["step"] for r in extended["rows"] if "loss" in r] == list(range(1, 31))
    assert without_timing(extended["rows"]) == without_timing(whole["rows"])
    assert extended["extended_from"] == at and extended["wall_s"] > piece["wall_s"] > 0
    assert not (out / "run" / "stopped.json").exists()


def test_a_run_that_fails_is_an_error_not_a_stop_and_says_why(tmp_path):
    """The study prints no child's output, so its error repeats the child's last word (here its argument check's)."""
    with pytest.raises(RuntimeError, match=r"exited with status 2: grpo.py: error: --steps must be >= 1 \(got 0\)$"):
        run_jobs([Job("bad", "grpo.py", [*FLAGS, "--steps", "0"])], str(tmp_path))
    assert "--steps must be >= 1" in (tmp_path / "bad" / "stderr.log").read_text()  # the whole of it kept beside the run
