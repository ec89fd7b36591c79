"""Shared plumbing of the reproduction scripts: run algorithm scripts, read their metrics, plot."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.logging import read_metrics  # noqa: E402


@dataclass
class Job:
    name: str  # run name, unique within the reproduction
    script: str  # grpo.py, gapo.py, ...
    flags: list[str]


STOPPED = 130  # the scripts' exit status after Ctrl-C or SIGTERM: the step finished, a checkpoint written


def run_jobs(jobs: list[Job], output_dir: str, workers: int = 1, start: bool = True) -> dict[str, dict]:
    """Run each job (skipping finished ones), `workers` at a time, each with 2 // workers threads; with start=False
    run none and read those that have finished, to the job's --steps (a study spread over sessions: --finished-only).
    A run stopped by SIGTERM or Ctrl-C (`pkill -TERM -f 'run-name <name>'` at a session's end: it finishes its step and
    checkpoints) stops the study; the same command resumes it from that checkpoint, wall time and peak memory summed
    over the pieces. A run killed outright (SIGKILL, a lost machine) leaves no stopped.json and starts again. A child's
    stderr is kept beside its run (<run>/stderr.log); a failed run's error repeats its last line.
    Returns {name: {"rows": metrics rows, "wall_s": seconds, "peak_rss_mb": the process's peak memory}}."""
    threads = str(max(1, (os.cpu_count() or 2) // workers))

    def one(job: Job) -> tuple[str, dict | None]:
        run_dir = ROOT / output_dir / job.name
        done, stopped = run_dir / "done.json", run_dir / "stopped.json"
        if not done.exists() and (run := kept(job, output_dir)):  # finished on another machine: its kept log
            return job.name, run
        record = next((path for path in (done, stopped) if path.exists()), None)  # the pieces so far, if any
        before = json.loads(record.read_text()) if record else {}
        if not done.exists() or shorter(run_dir, job):  # not run yet, stopped, or a finished shorter run: extended from
            if not start:  # its last checkpoint
                return job.name, None
            resume = ["--resume", str(run_dir)] if before else []
            if before:
                before["extended_from"] = read_metrics(run_dir)[-1]["step"]
            t0 = time.time()
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "stderr.log", "a") as err:  # the child's warnings and errors, kept beside its run
                proc = subprocess.Popen([sys.executable, job.script, *job.flags, *resume, "--output-dir", output_dir,
                                         "--run-name", job.name], cwd=ROOT, stderr=err, stdout=subprocess.DEVNULL,
                                        env={**os.environ, "OMP_NUM_THREADS": threads})
                _, status, usage = os.wait4(proc.pid, 0)  # the child's own resource usage, peak memory included
            wall = time.time() - t0 + before.get("wall_s", 0.0)  # all the pieces
            piece = {**before, "wall_s": wall, "peak_rss_mb": max(usage.ru_maxrss / 1024, before.get("peak_rss_mb", 0.0)),
                     **provenance(before)}
            code = os.waitstatus_to_exitcode(status)  # wait4's status is encoded (exit 130 reads 33280)
            if code == STOPPED:
                stopped.write_text(json.dumps(piece) + "\n")
                raise SystemExit(f"{job.name}: stopped at step {read_metrics(run_dir)[-1]['step']} (checkpointed); the same "
                                 "command extends it")
            if code != 0:
                said = [line for line in (run_dir / "stderr.log").read_text().splitlines() if line.strip()]
                raise RuntimeError(f"{job.name}: {job.script} {' '.join(job.flags)} exited with status {code}: "
                                   f"{said[-1] if said else '(nothing on stderr)'}")
            done.write_text(json.dumps(piece) + "\n")
            stopped.unlink(missing_ok=True)
            print(f"  {job.name}: {wall:.0f}s", flush=True)
        keep_log(job, run_dir, output_dir)  # every real-model run read, whether run now or before
        return job.name, {"rows": read_metrics(run_dir), **json.loads(done.read_text())}

    with ThreadPoolExecutor(workers) as pool:
        return {name: run for name, run in pool.map(one, jobs) if run is not None}


LOGS = ROOT / "repro" / "results" / "logs"
CODE = ("*.py", "common", "pyproject.toml")  # what a run's numbers are a function of, besides its flags and the machine


def git(*words: str) -> str:
    out = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def cpu_model() -> str:
    """The CPU's model name, and the vector instructions torch's kernels pick from (they decide the rounding)."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def provenance(before: dict) -> dict:
    """What a run ran on, for its done.json and kept log: the commit checked out, the last commit that changed its code
    (CODE; '+dirty' where those files had uncommitted changes) and the CPU. A run resumed on other code or another CPU
    lists each piece's, joined by ' + '."""
    code = git("log", "-1", "--format=%h", "--", *CODE) + ("+dirty" if git("status", "--porcelain", "--", *CODE) else "")
    now = {"commit": git("rev-parse", "--short", "HEAD"), "code": code, "cpu": cpu_model()}
    for key, value in now.items():
        if before.get(key) and value not in before[key].split(" + "):
            now[key] = f"{before[key]} + {value}"
    return now


# a seed's K = 0 run, grpo.py on the recipe: the recipe study's kept log, else benchmarks/study_run.py's `after` arm (the
# same flags and seed, run with the products, oneDNN's, of the code that runs the studies now)
K0_LOGS = ("repro_real_model_recipe/shaped_lr1e-5_s{seed}.jsonl", "bench_study_run_onednn/K0_s{seed}_after.jsonl")


def k0_logs() -> dict[int, Path]:
    """{seed: its K = 0 run's kept log} for every seed that has one, the first of K0_LOGS that exists: the one run every
    real-model table compares a seed's other runs against."""
    found: dict[int, Path] = {}
    for name in K0_LOGS:
        head, tail = name.split("{seed}")
        for path in LOGS.glob(f"{head}*{tail}"):
            found.setdefault(int(path.relative_to(LOGS).as_posix()[len(head):-len(tail)]), path)
    return dict(sorted(found.items()))


def keep_log(job: Job, run_dir: Path, output_dir: str) -> None:
    """A real-model run's per-step metrics and wall time, copied to repro/results/logs/<study>/<run>.jsonl (in git:
    runs/ is not, and a later question, such as which diagnostic warned first, is asked of every run's log)."""
    model = job.flags[job.flags.index("--model") + 1] if "--model" in job.flags else "embedded"
    if model == "embedded":
        return
    out = LOGS / Path(output_dir).name / f"{job.name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text((run_dir / "metrics.jsonl").read_text() + (run_dir / "done.json").read_text())


def kept(job: Job, output_dir: str) -> dict | None:
    """The run as run_jobs returns it, from the kept log of a finished run at least as long as the job (runs/ does not
    survive a fresh machine, the logs in git do; a shorter one has no checkpoint to extend); None if there is none."""
    log = LOGS / Path(output_dir).name / f"{job.name}.jsonl"
    if not log.exists():
        return None
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # metrics rows, then done.json (keep_log)
    rows, done = [row for row in lines if "step" in row], lines[-1]
    return {"rows": rows, **done} if rows[-1]["step"] >= steps(job) else None


def steps(job: Job) -> int:
    """The job's --steps (0 if it leaves the script's default; the last where an arm's flags set it again)."""
    if "--steps" not in job.flags:
        return 0
    return int(job.flags[len(job.flags) - 1 - job.flags[::-1].index("--steps") + 1])  # the last one given: it counts


def shorter(run_dir: Path, job: Job) -> bool:
    """Whether the finished run in run_dir stopped before the job's --steps (so the job extends it by resuming;
    async_grpo.py's emulated mode and grpo.py resume exactly, tested in tests/test_async_grpo.py and test_checkpoint.py)."""
    return json.loads((run_dir / "args.json").read_text())["steps"] < steps(job)


def command(script: str, args, always: tuple[str, ...]) -> str:
    """`python <script>` with the flags that reproduce args (a tyro dataclass of values, lists and booleans: tyro's
    --flag / --no-flag): the fields named in `always`, then each other field not at its default (--name among them:
    without it a study's command writes its default results file)."""
    default, words = type(args)(), ["python", script]
    for field in fields(args):
        value, flag = getattr(args, field.name), field.name.replace("_", "-")
        if field.name not in always and value == getattr(default, field.name):
            continue
        if isinstance(value, bool):
            words.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            words += [f"--{flag}", *map(str, value if isinstance(value, list) else [value])]
    return " ".join(words)


def read_log(path: Path) -> list[dict]:
    """The metrics rows of a log kept by keep_log (its last line, the wall time, left out)."""
    return [row for line in path.read_text().splitlines() if "step" in (row := json.loads(line))]


def evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/pass@1" in r]


def collapsed(rows: list[dict]) -> bool:
    """A run collapsed if its final held-out pass@1 is below half its best, or below the base model's."""
    p = [r["eval/pass@1"] for r in evals(rows)]
    return p[-1] < 0.5 * max(p) or p[-1] < p[0]


def first_step_reaching(rows: list[dict], key: str, threshold: float) -> int | None:
    """The first evaluated step at which rows[key] >= threshold (None if never)."""
    return next((r["step"] for r in evals(rows) if r[key] >= threshold), None)


def over_steps(rows: list[dict], key: str, reduce=statistics.mean) -> float:
    """reduce (mean, median, max, ...) of rows[key] over the steps that logged it; NaN if none did."""
    values = [r[key] for r in rows if key in r]
    return reduce(values) if values else float("nan")


def mean_over_steps(rows: list[dict], key: str) -> float:
    return over_steps(rows, key)


def mean_sd(values: list[float], missing: str = "–") -> str:
    """'mean ± sd' of the values that are there (None and NaN are dropped); `missing` if none is."""
    values = [v for v in values if v is not None and v == v]
    if not values:
        return missing
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def save_table(name: str, text: str) -> Path:
    """Print the table and write it to repro/results/<name>.md; returns the results directory."""
    print(text)
    out = ROOT / "repro" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    return out


def pyplot():
    """matplotlib.pyplot with a file backend, or None if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no figure")
        return None


def smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing moving average."""
    out = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        out.append(sum(recent) / len(recent))
    return out
