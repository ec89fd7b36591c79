"""Tasks: a train and a test `datasets.Dataset` with `prompt` and `answer` columns, and a reward.

    reward(completions: list[str], answers: list[str]) -> list[float] in [0, 1]

A completion counts as a success when its reward is 1 (pass@k is computed on successes).

Embedded tasks (offline, generated from a fixed seed, each with a warm-started tiny model):
    reverse       "40213>" -> "31204"      exact match (the default job; 3-5 digits)
    reverse-long  "510293>" -> "392015"    exact match, 4-6 digits: a hard task (base pass@1 under 15 %)
    add           "47+85=" -> "132"        partial progress: fraction of digits right, aligned on the units
    chain-N       multi-turn (N model turns, 2 <= N <= 16): a running sum mod 10, one operand a turn,
                  "4+3=" -> "7", env "+5=" -> "2", env "+9=" -> "1"; success: the last sum is right.
                  chain-N: outcome reward (1 at the last turn if right); chain-N-partial: 1/N per turn
                  whose sum is right (progress credit); chain-N-sum: the two added. One warm-started
                  model (common/weights/chain) serves every N.
Real tasks:
    gsm8k    hub id `openai/gsm8k`, or a local .json/.jsonl file with `question` (or `prompt`) and
             `answer` fields; the reference answer is the number after `####` (or the whole answer).
    gsm8k-turns  the same rows, multi-turn: one turn per step of the worked answer, then the final answer;
             1/N for each right turn (StepsEnv). --extra-eval-data-path sets are evaluated single-turn.
    math     local MATH-format files (`problem`, `solution` with \boxed{}), scored by math-verify.
    data     any local data file with your reward functions (common/user_tasks.py).
--reward module:function (several, --reward-weights) replaces a task's reward with the weighted sum of
yours; each function gets the completions, the answers and the row's other columns.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable

from datasets import Dataset

from common.cli import ConfigError

EMBEDDED_TASKS = ("reverse", "reverse-long", "add")  # single-turn; each has a model in common/weights/<name>
EMBEDDED_MODELS = EMBEDDED_TASKS + ("chain",)  # the directories of common/weights/
TASKS = ("reverse", "reverse-long", "add", "chain-N[-partial|-sum]", "gsm8k", "gsm8k-turns", "math", "data")
DATA_SEED = 1234  # the embedded data sets are the same for every run and every seed


@dataclass
class Task:
    name: str
    train: Dataset
    test: Dataset
    reward: Callable[[list[str], list[str]], list[float]] | None  # None for a multi-turn task (its environment rewards;
    # gsm8k-turns keeps gsm8k_reward for its single-turn --extra-eval-data-path sets)
    max_new_tokens: int  # default completion budget for this task (of one model turn, for a multi-turn task)
    env: Callable[[str], object] | None = None  # multi-turn: answer -> a fresh environment (common/multiturn.py) or None
    formatted: Callable[[list[str]], list[bool]] | None = None  # whether each completion gives its answer in the task's format
    reward_functions: list | None = None  # --reward: user functions by import path, weighted (common/user_tasks.py)
    extra_tests: dict = field(default_factory=dict)  # --extra-eval-data-path: name -> more held-out rows, evaluated too

    def envs(self, answers: list[str]) -> list | None:
        """One environment per row for a multi-turn task; None for a single-turn task or set (env(answer) is None for
        a row it cannot serve: gsm8k-turns' --extra-eval-data-path sets, whose answers are final numbers, single-turn)."""
        envs = None if self.env is None else [self.env(a) for a in answers]
        return None if envs is None or any(e is None for e in envs) else envs

    def formatted_rows(self, batch) -> list[bool]:
        """Whether each sampled row gives its answer in the task's format (self.formatted): a trajectory by its last
        model turn, once the environment asked for the final answer (its observations are not the model's)."""
        if batch.turn_texts is None:
            return self.formatted(batch.texts)
        last = self.formatted([turns[-1] if turns else "" for turns in batch.turn_texts])
        return [f and done for f, done in zip(last, batch.done)]

    def score(self, batch, answers: list[str], rows=None, parts: dict | None = None) -> tuple[list[float], list[bool]]:
        """The reward of each row and whether it succeeded (what pass@k counts): the environment's reward
        summed over turns and its verdict, or the task's reward of the completion (the weighted --reward
        functions, given the answers and the other columns of `rows`, the prompts' Dataset rows) and
        reward >= 1. With --reward functions, `parts` (if given) receives each one's values by name."""
        if batch.rewards is not None:
            return batch.rewards, batch.successes
        if self.reward_functions:
            from common.user_tasks import weighted_reward

            extra = [c for c in (rows.column_names if rows is not None else []) if c not in ("prompt", "answer")]
            repeat = len(answers) // len(rows) if rows is not None else 1
            columns = {c: [v for v in rows[c] for _ in range(repeat)] for c in extra}
            rewards, values = weighted_reward(self.reward_functions, batch.texts, answers, columns)
            if parts is not None:
                parts.update(values)
        else:
            rewards = self.reward(batch.texts, answers)
        return rewards, [r >= 1.0 for r in rewards]


# ---------------------------------------------------------------- embedded tasks
def reverse_example(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
    return f"{digits}>", digits[::-1]


def reverse_long_example(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6)))
    return f"{digits}>", digits[::-1]


def add_example(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


EXAMPLES = {"reverse": reverse_example, "reverse-long": reverse_long_example, "add": add_example}


def reverse_noisy_label(answer: str, rng: random.Random) -> str:
    """Warm-start label noise for `reverse`: the digits in a random order."""
    return "".join(rng.sample(answer, len(answer)))


def add_noisy_label(answer: str, rng: random.Random) -> str:
    """Warm-start label noise for `add`: each digit replaced by a random one with probability 1/2."""
    return "".join(rng.choice("0123456789") if rng.random() < 0.5 else d for d in answer)


NOISY_LABELS = {"reverse": reverse_noisy_label, "reverse-long": reverse_noisy_label, "add": add_noisy_label}


def exact_match_reward(completions: list[str], answers: list[str], **_) -> list[float]:
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


def digit_match_reward(completions: list[str], answers: list[str], **_) -> list[float]:
    """Fraction of digit positions right, aligned on the units digit, over the longer string."""
    rewards = []
    for c, a in zip(completions, answers):
        c = c.strip()
        hits = sum(x == y for x, y in zip(reversed(c), reversed(a)))
        rewards.append(hits / max(len(c), len(a)))
    return rewards


def embedded_dataset(name: str, n: int, seed: int, exclude: set[str] = frozenset()) -> Dataset:
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        prompt, answer = EXAMPLES[name](rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer})
    return Dataset.from_list(rows)


def embedded_task(name: str, num_test: int = 128, num_train: int = 5000) -> Task:
    test = embedded_dataset(name, num_test, DATA_SEED)
    train = embedded_dataset(name, num_train, DATA_SEED + 1, exclude=set(test["prompt"]))
    reward = digit_match_reward if name == "add" else exact_match_reward
    return Task(name, train, test, reward, max_new_tokens=8)


# ---------------------------------------------------------------- the multi-turn chain
CHAIN = re.compile(r"chain-(\d+)(?:-(partial|sum))?")
CHAIN_MAX_TURNS = 16  # the tiny model has 128 positions: 4 + 16 * 2 + 15 * 3 tokens


def chain_example(rng: random.Random, turns: int) -> tuple[str, str]:
    """The prompt (first two operands) and the answer: all turns + 1 operands, e.g. ("4+3=", "4359")."""
    operands = "".join(rng.choice("0123456789") for _ in range(turns + 1))
    return f"{operands[0]}+{operands[1]}=", operands


def running_sums(operands: str) -> list[str]:
    """The right answer of each turn: sum of the operands so far, mod 10."""
    sums, total = [], int(operands[0])
    for d in operands[1:]:
        total = (total + int(d)) % 10
        sums.append(str(total))
    return sums


class ChainEnv:
    """Add the next operand to the running sum (mod 10), one turn at a time."""

    max_tokens = 124  # the tiny model's 128 positions less the 4-token prompt

    def __init__(self, operands: str, reward: str = "outcome"):
        self.sums, self.operands, self.reward = running_sums(operands), operands, reward
        self.max_turns = len(self.sums)
        self.turn, self.success = 0, False

    def reset(self, prompt: str) -> str:
        self.turn, self.success = 0, False
        return prompt

    def step(self, turn: str) -> tuple[str, float, bool]:
        right = turn.strip() == self.sums[self.turn]
        self.turn += 1
        done = self.turn == self.max_turns
        self.success = done and right
        outcome, partial = float(done and right), right / self.max_turns  # partial: credit per correct step
        reward = {"outcome": outcome, "partial": partial, "sum": outcome + partial}[self.reward]
        return ("" if done else f"+{self.operands[self.turn + 1]}="), reward, done


def chain_dataset(turns: int, n: int, seed: int, exclude: set[str] = frozenset()) -> Dataset:
    """n distinct operand sequences (fewer if 10^(turns + 1) - |exclude| is smaller), none in exclude."""
    n = min(n, 10 ** (turns + 1) - len(exclude))
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        prompt, answer = chain_example(rng, turns)
        if answer not in seen:
            seen.add(answer)
            rows.append({"prompt": prompt, "answer": answer})
    return Dataset.from_list(rows)


def chain_task(name: str, num_test: int = 128, num_train: int = 5000) -> Task:
    match = CHAIN.fullmatch(name)
    turns, reward = int(match.group(1)), match.group(2) or "outcome"
    if not 2 <= turns <= CHAIN_MAX_TURNS:
        raise ConfigError(f"--task {name}: the number of turns must be in [2, {CHAIN_MAX_TURNS}] (got {turns})")
    test = chain_dataset(turns, num_test, DATA_SEED)
    train = chain_dataset(turns, num_train, DATA_SEED + 1, exclude=set(test["answer"]))
    return Task(name, train, test, reward=None, max_new_tokens=3, env=lambda answer: ChainEnv(answer, reward))


def embedded_model_name(task: str) -> str | None:
    """The directory under common/weights/ of a task's embedded model (every chain-N shares `chain`)."""
    if CHAIN.fullmatch(task):
        return "chain"
    return task if task in EMBEDDED_TASKS else None


# ---------------------------------------------------------------- GSM8K
GSM8K_INSTRUCTION = "\nSolve the problem step by step, then give the final answer after '####'."
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def extract_number(text: str) -> Decimal | None:
    """The final answer of a GSM8K completion: the first number after the last '####' if there is
    one, else the last number in the text. Commas in thousands, '$' and signs are handled, and
    3.50 == 3.5."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        match = _NUMBER.search(tail)
        matches = [match] if match else []
    else:
        matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    try:
        return as_decimal(matches[-1].group())
    except InvalidOperation:
        return None


def as_decimal(number: str) -> Decimal:
    """A number as _NUMBER matches it ('1,250', '+3', '.5') as a Decimal: 3.50 == 3.5."""
    return Decimal(number.replace(",", "").lstrip("+"))


def gsm8k_formatted(completions: list[str]) -> list[bool]:
    """Whether each completion marks its final answer as GSM8K does: a number after the last '####'."""
    return ["####" in c and _NUMBER.search(c.rsplit("####", 1)[1]) is not None for c in completions]


def gsm8k_format_reward(completions: list[str], answers: list[str], **_) -> list[float]:
    """1 if the completion gives its final answer as GSM8K asks (a number after '####'), whatever the number: a
    shaping reward to add, weighted, to gsm8k_reward (--reward common.tasks:gsm8k_reward common.tasks:gsm8k_format_reward)."""
    return [float(f) for f in gsm8k_formatted(completions)]


_RESULT = re.compile(r"=\s*\$?(" + _NUMBER.pattern + ")")


def intermediate_results(answer: str) -> list[Decimal]:
    """The results of a worked solution's steps before its last: each number after an '=' above the '####' line
    (the word problems' '5 x 9 = 45', GSM8K's '<<5*9=45>>45'), in order, repeats and the final answer dropped."""
    results: list[Decimal] = []
    for match in _RESULT.finditer(answer.rsplit("####", 1)[0]):
        value = as_decimal(match.group(1))
        if value not in results:
            results.append(value)
    final = extract_number(answer)
    return [v for v in results if v != final]


def gsm8k_steps_reward(completions: list[str], answers: list[str], solution: list[str], **_) -> list[float]:
    """Partial credit for a multi-step solution: the share of the worked solution's intermediate results (in order,
    up to the first one missing) that the completion writes; 0 for a one-step problem (or an answer with no worked
    steps), the same for every completion of its group, so no advantage. A shaping reward to add, weighted, to
    gsm8k_reward: groups whose completions all miss the final answer are ranked by how far they got
    (repro/README.md, "Why accuracy does not transfer")."""
    rewards = []
    for c, a in zip(completions, solution):
        results, written = intermediate_results(a), {as_decimal(n) for n in _NUMBER.findall(c)}
        reached = next((k for k, v in enumerate(results) if v not in written), len(results))
        rewards.append(reached / len(results) if results else 0.0)
    return rewards


def gsm8k_reward(completions: list[str], answers: list[str], **_) -> list[float]:
    rewards = []
    for c, a in zip(completions, answers):
        predicted, reference = extract_number(c), extract_number(a)
        rewards.append(float(predicted is not None and predicted == reference))
    return rewards


def read_rows(path: str) -> list[dict]:
    """Rows of a .jsonl (one object a line) or .json (a list of objects, or {"data": [...]}) file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data-path {path}: no such file")
    text = p.read_text()
    if p.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path} line {i + 1}: not valid JSON ({e.msg})") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    rows = data.get("data") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: expected a list of rows or an object with a 'data' list")
    return rows


def gsm8k_rows(rows: list[dict], source: str) -> list[dict]:
    """Check every row and turn it into {prompt, answer: the final number, solution: the worked answer as given};
    a bad row is named by its index."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{source} row {i}: expected an object, got {type(row).__name__}")
        question = row.get("question", row.get("prompt"))
        if not isinstance(question, str) or not question.strip():
            raise ConfigError(f"{source} row {i}: needs a non-empty string field 'question' (or 'prompt')")
        answer = row.get("answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or extract_number(answer) is None:
            raise ConfigError(f"{source} row {i}: field 'answer' must contain a final number (e.g. '#### 42')")
        out.append({"prompt": question.strip() + GSM8K_INSTRUCTION, "answer": str(extract_number(answer)), "solution": answer})
    if not out:
        raise ConfigError(f"{source}: no rows")
    return out


def gsm8k_task(data_path: str | None, eval_data_path: str | None, num_test: int) -> Task:
    if data_path is None:
        from datasets import load_dataset

        hub = load_dataset("openai/gsm8k", "main")
        train = gsm8k_rows(list(hub["train"]), "openai/gsm8k train")
        test = gsm8k_rows(list(hub["test"]), "openai/gsm8k test")[:num_test]
    else:
        train = gsm8k_rows(read_rows(data_path), data_path)
        if eval_data_path is not None:
            test = gsm8k_rows(read_rows(eval_data_path), eval_data_path)[:num_test]
        else:  # hold out the last rows of the file (at most half of it)
            held_out = min(num_test, len(train) // 2)
            if held_out == 0:
                raise ConfigError(f"--data-path {data_path}: needs at least 2 rows, or pass --eval-data-path")
            train, test = train[:-held_out], train[-held_out:]
    return Task("gsm8k", Dataset.from_list(train), Dataset.from_list(test), gsm8k_reward, max_new_tokens=256,
                formatted=gsm8k_formatted)


# ---------------------------------------------------------------- GSM8K, one step a turn
TURNS_INSTRUCTION = "\nSolve the problem one step at a time. Reply with the result of the first step only."
NEXT_TURN = "Reply with the result of the next step only."
LAST_TURN = "Now give the final answer after '####'."
TURNS_MAX_TOKENS = 1024  # a trajectory's model and environment tokens after the prompt


def step_results(solution: str) -> list[Decimal]:
    """The result of each line of a worked solution above '####' that computes one (its last '= N'), repeats kept,
    and the last line's dropped where it is the final answer (the final turn asks for that): the turns before the last."""
    lines = solution.rsplit("####", 1)[0].splitlines()
    results = [as_decimal(found[-1]) for line in lines if (found := _RESULT.findall(line))]
    return results[:-1] if results and results[-1] == extract_number(solution) else results


class StepsEnv:
    """A worked solution asked one step at a time (the chain task's design on word problems): turn k asks for the
    k-th line's result (step_results), the last turn for the final answer; a turn is right if the number it gives
    (extract_number: the one after '####', else its last) is that result, and earns 1 / N of the N turns; the
    trajectory succeeds if the final answer is right. A one-step problem is one turn: the single-turn task."""

    max_tokens = TURNS_MAX_TOKENS

    def __init__(self, solution: str):
        self.results = [*step_results(solution), extract_number(solution)]
        self.max_turns = len(self.results)
        self.turn, self.success = 0, False

    def reset(self, prompt: str) -> str:
        self.turn, self.success = 0, False
        return prompt

    def step(self, turn: str) -> tuple[str, float, bool]:
        k, self.turn = self.turn, self.turn + 1
        done = self.turn == self.max_turns
        right = extract_number(turn) == self.results[k]
        self.success = done and right
        observation = "" if done else LAST_TURN if self.turn == self.max_turns - 1 else NEXT_TURN
        return observation, right / self.max_turns, done


def gsm8k_turns_task(data_path: str | None, eval_data_path: str | None, num_test: int) -> Task:
    """--task gsm8k-turns: GSM8K's rows (the same files and checks as gsm8k) asked one step a turn (StepsEnv); the
    answer column holds the worked solution the environment reads."""
    single = gsm8k_task(data_path, eval_data_path, num_test)

    def turns(rows: Dataset, source: str) -> Dataset:
        for i, r in enumerate(rows):
            if "####" not in r["solution"]:
                raise ConfigError(f"{source} row {i}: --task gsm8k-turns needs a worked answer ending in '#### N'")
        return Dataset.from_list([{
            "prompt": r["prompt"].removesuffix(GSM8K_INSTRUCTION)
            + (TURNS_INSTRUCTION if step_results(r["solution"]) else GSM8K_INSTRUCTION),
            "answer": r["solution"], "solution": r["solution"]} for r in rows])

    train_source, test_source = data_path or "openai/gsm8k train", eval_data_path or data_path or "openai/gsm8k test"
    return Task("gsm8k-turns", turns(single.train, train_source), turns(single.test, test_source), gsm8k_reward, max_new_tokens=256,
                env=lambda answer: StepsEnv(answer) if "####" in answer else None, formatted=gsm8k_formatted)


def user_task(name: str, data_path: str | None, eval_data_path: str | None, num_test: int, prompt_column: str,
              answer_column: str, eval_fraction: float | None) -> Task:
    """--task data (your columns, your rewards) or --task math (MATH rows, math-verify)."""
    from common import user_tasks as u

    if data_path is None:
        raise ConfigError(f"--task {name} needs --data-path (a local .json, .jsonl, .csv or .parquet file)")
    data = u.read_data(data_path)
    eval_data = u.read_data(eval_data_path, "--eval-data-path") if eval_data_path is not None else None
    if name == "math":
        data, eval_data = u.math_rows(data, data_path), eval_data and u.math_rows(eval_data, eval_data_path)
        train, test = u.split(data, eval_data, eval_fraction, num_test, data_path)
        return Task("math", train, test, u.math_reward, max_new_tokens=512,
                    formatted=lambda completions: [u.last_boxed(c) is not None for c in completions])
    for d, source in ((data, data_path), (eval_data, eval_data_path)):
        if d is not None:
            u.check_rows(d, source, prompt_column, answer_column)
    train, test = u.split(data, eval_data, eval_fraction, num_test, data_path)
    return Task("data", u.as_task_rows(train, prompt_column, answer_column), u.as_task_rows(test, prompt_column, answer_column),
                reward=None, max_new_tokens=256)


def load_task(name: str, data_path: str | None = None, eval_data_path: str | None = None, num_test: int = 128,
              train_size: int | None = None, prompt_column: str = "prompt", answer_column: str = "answer",
              rewards: list[str] | None = None, reward_weights: list[float] | None = None,
              eval_fraction: float | None = None, extra_eval_paths: list[str] | None = None) -> Task:
    """The task `name`; train_size keeps only the first N training prompts (a small pool is revisited often);
    rewards (import paths, weighted) replace the task's own reward; extra_eval_paths are more held-out files of the
    --eval-data-path form, each evaluated too and logged by its file name."""
    if embedded_model_name(name) is None and name not in ("gsm8k", "gsm8k-turns", "math", "data"):
        raise ConfigError(f"--task {name!r} is not one of: {', '.join(TASKS)}")
    if eval_fraction is not None and not (name in ("math", "data") and 0 < eval_fraction < 1):
        raise ConfigError(f"--eval-fraction must be in (0, 1), with --task math or data (got {eval_fraction} with {name})")
    functions = None
    if rewards:
        from common.user_tasks import load_rewards

        functions = load_rewards(rewards, reward_weights)
    elif reward_weights:
        raise ConfigError("--reward-weights needs --reward functions")
    if name in ("math", "data"):
        if name == "data" and not functions:
            raise ConfigError("--task data needs at least one --reward module:function (see common/user_tasks.py)")
        task = user_task(name, data_path, eval_data_path, num_test, prompt_column, answer_column, eval_fraction)
    elif name == "gsm8k-turns":
        task = gsm8k_turns_task(data_path, eval_data_path, num_test)
    elif name != "gsm8k":
        if data_path is not None:
            raise ConfigError(f"--data-path is only used with --task gsm8k, math or data, not with the embedded task {name!r}")
        task = chain_task(name, num_test) if CHAIN.fullmatch(name) else embedded_task(name, num_test)
    else:
        task = gsm8k_task(data_path, eval_data_path, num_test)
    if functions:
        if task.env is not None:
            raise ConfigError(f"--reward: the multi-turn task {name} is rewarded by its environment")
        task.reward_functions = functions
    for path in extra_eval_paths or []:
        if name not in ("gsm8k", "gsm8k-turns", "math", "data"):
            raise ConfigError(f"--extra-eval-data-path is for --task gsm8k, gsm8k-turns, math or data (got {name})")
        if Path(path).stem in task.extra_tests:
            raise ConfigError(f"--extra-eval-data-path: two files are named {Path(path).stem} (their metrics would merge)")
        again = gsm8k_task(data_path, path, num_test) if name.startswith("gsm8k") else \
            user_task(name, data_path, path, num_test, prompt_column, answer_column, None)
        task.extra_tests[Path(path).stem] = again.test  # read and checked as --eval-data-path is
    if train_size is not None:
        if not 1 <= train_size <= len(task.train):
            raise ConfigError(f"--train-size must be in [1, {len(task.train)}] for --task {name} (got {train_size})")
        task.train = task.train.select(range(train_size))
    return task
