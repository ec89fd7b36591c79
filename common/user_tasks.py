"""Bring your own task: a local data file, reward functions by import path, and MATH-format problems.

    --task data --data-path train.parquet [--eval-data-path test.parquet | --eval-fraction 0.1]
                --prompt-column question --answer-column answer --reward my_rewards:exact_match ...
    --task math --data-path math_train.jsonl     (MATH's `problem` and `solution` with \\boxed{}; math-verify)

A data file is anything `datasets` reads by its extension: .json, .jsonl, .csv (every column read as
text), .parquet. The prompt
column holds text, or chat messages ([{"role": ..., "content": ...}, ...]) that the tokenizer's chat
template renders; the answer column is what the reward functions compare against. Every other column
of the row reaches the reward functions as a keyword argument. A reward function is

    def exact_match(completions: list[str], answers: list[str], **columns) -> list[float]

named by its import path (`module:function`; the working directory is importable), several with
--reward-weights; the task's reward is their weighted sum and each is logged as reward/<function> (as
reward/<module:function> where two share a name). Values may be Python, numpy or one-element torch numbers.
A reward that raises, returns the wrong number of values, or a NaN or infinite value stops the run
with an error naming it, before any update is taken from it. A completion counts as a success (what
pass@k counts) when its reward is at least 1.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from datasets import Dataset

from common.cli import ConfigError

DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class RewardError(ConfigError):
    """A reward function misbehaved: the run stops before an update is taken from its values."""


def as_reward(value) -> float | None:
    """A reward value as a float: Python, numpy and one-element torch numbers are accepted; None if it is not a
    finite number."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool:
            return None
        value = value.item()
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if not isinstance(value, (numbers.Real, np.floating, np.integer)) or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass
class RewardFunction:
    path: str  # module:function
    fn: Callable
    weight: float
    name: str = ""  # the key of its values and its log, reward/<name>: the function's name, or its path if two share it

    def __call__(self, completions: list[str], answers: list[str], columns: dict[str, list]) -> list[float]:
        try:
            values = self.fn(completions, answers, **columns)
        except Exception as e:  # noqa: BLE001 -- any failure of user code stops the run, named
            raise RewardError(f"reward {self.path} raised {type(e).__name__}: {e}") from e
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise RewardError(f"reward {self.path} returned {type(values).__name__} {values!r:.60}: expected a list of "
                              f"{len(completions)} numbers, one per completion")
        values = list(values)
        if len(values) != len(completions):
            raise RewardError(f"reward {self.path} returned {len(values)} values for {len(completions)} completions")
        floats = [as_reward(v) for v in values]
        for i, (v, f) in enumerate(zip(values, floats)):
            if f is None:
                raise RewardError(f"reward {self.path} returned {v!r:.60} for completion {i}: rewards must be finite numbers")
        return floats


TOTALS = {"mean", "std", "group_std_mean"}  # reward/<these> are the scripts' own totals: a function so named logs by path


def load_rewards(paths: list[str], weights: list[float] | None) -> list[RewardFunction]:
    """Import each `module:function` (checked now, before any model is built). Each is keyed, and logged, by its
    function name, or by its whole path where two functions share a name (a:score and b:score) or where the name is
    one of the totals the scripts log as reward/<name> (a function `mean` is logged as reward/<module>:mean)."""
    weights = list(weights) if weights else [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ConfigError(f"--reward-weights has {len(weights)} values for {len(paths)} --reward functions")
    for path, weight in zip(paths, weights):
        if not math.isfinite(weight):
            raise ConfigError(f"--reward-weights: the weight of {path} is {weight}; weights must be finite numbers")
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise ConfigError(f"--reward {repeated[0]} is given twice; give it once, with its weight in --reward-weights")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a rewards file next to where the run starts
    functions = []
    for path, weight in zip(paths, weights):
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--reward {path}: expected module:function, e.g. my_rewards:exact_match")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"--reward {path}: cannot import {module_name} ({e})") from None
        except Exception as e:  # noqa: BLE001 -- the module's own code failed while it was imported
            raise ConfigError(f"--reward {path}: importing {module_name} raised {type(e).__name__}: {e}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"--reward {path}: {module_name} has no function {attr}")
        functions.append(RewardFunction(path, fn, float(weight)))
    short = [p.rsplit(":", 1)[-1] for p in paths]
    for f, name in zip(functions, short):
        f.name = name if short.count(name) == 1 and name not in TOTALS else f.path
    return functions



def weighted_reward(functions: list[RewardFunction], completions: list[str], answers: list[str],
                    columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
    """sum_f w_f r_f of each completion, and each function's own values (for reward/<name>)."""
    values = {f.name: f(completions, answers, columns) for f in functions}
    total = [sum(f.weight * values[f.name][i] for f in functions) for i in range(len(completions))]
    return total, values


def read_data(path: str, flag: str = "--data-path") -> Dataset:
    """A local data file as a Dataset, by its extension."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    if p.suffix not in DATA_FORMATS:
        raise ConfigError(f"{flag} {path}: expected one of {', '.join(DATA_FORMATS)}")
    from datasets import load_dataset

    text = {}
    if p.suffix == ".csv":  # CSV has no types: every column arrives as text ("007" stays "007")
        import csv

        from datasets import Features, Value

        with p.open(newline="") as f:
            header = next(csv.reader(f), [])
        text = {"features": Features({name: Value("string") for name in header})}
    try:
        return load_dataset(DATA_FORMATS[p.suffix], data_files=str(p), split="train", **text)
    except Exception as e:  # noqa: BLE001 -- a malformed file is the user's input: one line, named
        raise ConfigError(f"{flag} {path}: could not be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def check_rows(data: Dataset, source: str, prompt_column: str, answer_column: str) -> None:
    """Both columns present; every prompt non-empty text or chat messages; a bad row named by its index."""
    for column in (prompt_column, answer_column):
        if column not in data.column_names:
            raise ConfigError(f"{source}: no column {column!r} (columns: {', '.join(data.column_names)})")
    for i, prompt in enumerate(data[prompt_column]):
        text_ok = isinstance(prompt, str) and prompt.strip()
        chat_ok = isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        if not (text_ok or chat_ok):
            raise ConfigError(f"{source} row {i}: column {prompt_column!r} must be non-empty text or chat messages "
                              "[{'role': ..., 'content': ...}]")
    for i, answer in enumerate(data[answer_column]):
        if answer is None:
            raise ConfigError(f"{source} row {i}: column {answer_column!r} is empty")


def split(data: Dataset, eval_data: Dataset | None, eval_fraction: float | None, num_test: int, source: str):
    """The training rows and at most num_test held-out rows: a held-out file, a fraction of the training
    file's last rows, or (neither given) its last rows, at most half of them."""
    if eval_data is not None:
        return data, eval_data.select(range(min(num_test, len(eval_data))))
    held_out = round(eval_fraction * len(data)) if eval_fraction is not None else min(num_test, len(data) // 2)
    if not 1 <= held_out < len(data):
        raise ConfigError(f"{source}: {len(data)} rows leave no held-out split (pass --eval-data-path or --eval-fraction)")
    train, test = data.select(range(len(data) - held_out)), data.select(range(len(data) - held_out, len(data)))
    return train, test.select(range(min(num_test, len(test))))


def as_task_rows(data: Dataset, prompt_column: str, answer_column: str) -> Dataset:
    """The `prompt` and `answer` columns every script reads (answers as text), the others kept for the rewards."""
    data = data.map(lambda row: {"answer": str(row[answer_column])}, remove_columns=[answer_column])
    if prompt_column != "prompt":
        data = data.rename_column(prompt_column, "prompt")
    return data


# ---------------------------------------------------------------- MATH
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own default, per parse and per verify
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def math_reward(completions: list[str], answers: list[str], **_) -> list[float]:
    """1 if the completion's last \\boxed{} is mathematically equal to the reference (Hugging Face's math-verify:
    1/2 = 0.5 = \\frac{1}{2}, 2\\sqrt{3} = \\sqrt{12}, ...), else 0."""
    from math_verify import parse, verify

    # math-verify bounds each call with signal.alarm, which only the main thread may set; in another thread (async_grpo.py's
    # generation thread) it raises, so there the calls run without that timeout
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for completion, answer in zip(completions, answers):
        boxed = last_boxed(completion)
        if boxed is None:
            rewards.append(0.0)
            continue
        gold, guess = parse(f"${answer}$", parsing_timeout=timeout), parse(f"${boxed}$", parsing_timeout=timeout)
        rewards.append(float(bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=timeout)))
    return rewards


def math_rows(data: Dataset, source: str) -> Dataset:
    """MATH's rows: `problem` and a `solution` whose last \\boxed{} is the answer (or an `answer` column)."""
    if "problem" not in data.column_names:
        raise ConfigError(f"{source}: MATH rows need a 'problem' column (columns: {', '.join(data.column_names)})")
    answers = data["answer"] if "answer" in data.column_names else None
    rows = []
    for i, row in enumerate(data):
        answer = str(answers[i]) if answers is not None else last_boxed(row.get("solution") or "")
        if not answer:
            raise ConfigError(f"{source} row {i}: no answer (an 'answer' column, or a 'solution' with \\boxed{{...}})")
        rows.append({"prompt": row["problem"].strip() + MATH_INSTRUCTION, "answer": answer})
    return Dataset.from_list(rows)
