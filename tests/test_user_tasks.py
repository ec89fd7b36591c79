"""Bring your own task: local data files of every format datasets reads, reward functions by import path (weighted,
logged one by one, and stopped loudly when they misbehave), chat-message prompts, and MATH scored by math-verify."""

import json
import math

import pytest
from conftest import CHAT_TEMPLATE, small_args

import grpo
from common.cli import ConfigError
from common.logging import read_metrics
from common.sampling import encode_prompts
from common.tasks import load_task
from common.user_tasks import RewardError, math_reward

# Embedded `reverse` prompts with the answer in a column of our own name and a column a reward reads.
ROWS = [{"question": f"{n}>", "target": str(n)[::-1], "digits": len(str(n))} for n in range(100, 160)]

REWARDS = '''
def exact(completions, answers, **columns):
    return [float(c.strip() == a) for c, a in zip(completions, answers)]

def short(completions, answers, digits, **columns):  # reads a column of the row
    return [float(len(c.strip()) == int(d)) for c, d in zip(completions, digits)]  # int: a .csv column is text

def raises(completions, answers, **columns):
    raise KeyError("no such thing")

def too_few(completions, answers, **columns):
    return [1.0] * (len(completions) - 1)

def nan(completions, answers, **columns):
    return [float("nan")] + [0.0] * (len(completions) - 1)

def number(completions, answers, **columns):
    return 1.0

def numpy_floats(completions, answers, **columns):  # what `list(np.ones(n, np.float32))` users write gives
    import numpy as np
    return list(np.full(len(completions), 0.25, dtype=np.float32))

def torch_tensor(completions, answers, **columns):
    import torch
    return torch.full((len(completions),), 0.5)

def boxed_math(completions, answers, **columns):  # MATH's scoring (math-verify) of the completion as a boxed answer
    from common.user_tasks import math_reward
    return math_reward([f"\\\\boxed{{{c.strip()}}}" for c in completions], answers)
'''

# The same function name in two modules: a:score is 1, b:score is 0.
SCORE = "def score(completions, answers, **columns):\n    return [{}] * len(completions)\n"


@pytest.fixture
def user_files(tmp_path, monkeypatch, request):
    """The rows as .jsonl, .csv and .parquet, and a rewards module (a fresh name per test) in the working directory."""
    from datasets import Dataset

    monkeypatch.chdir(tmp_path)
    module = f"rewards_{request.node.name.split('[')[0][-30:]}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"))
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    return tmp_path, module


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_data_file_of_any_format_becomes_a_task_with_the_columns_named(user_files, suffix):
    tmp, module = user_files
    task = load_task("data", str(tmp / f"rows{suffix}"), None, 128, None, "question", "target", [f"{module}:exact"], None, 0.25)
    assert len(task.train) == 45 and len(task.test) == 15  # the last quarter held out
    assert task.train["prompt"][0] == "100>" and task.train["answer"][0] == "001" and task.test["prompt"][0] == "145>"
    assert "digits" in task.train.column_names  # the other columns reach the rewards


def test_weighted_rewards_see_the_rows_columns_and_each_is_logged(user_files):
    tmp, module = user_files
    args = small_args(grpo, tmp, task="data", model=grpo.resolve_model("embedded", "reverse"), data_path="rows.jsonl",
                      prompt_column="question", answer_column="target", reward=[f"{module}:exact", f"{module}:short"],
                      reward_weights=[1.0, 0.5], steps=2, eval_every=0, prompts_per_step=4)
    grpo.main(args)
    rows = read_metrics(tmp / "run")[1:]
    for r in rows:
        assert r["reward/mean"] == pytest.approx(r["reward/exact"] + 0.5 * r["reward/short"])
    assert any(r["reward/short"] > r["reward/exact"] for r in rows)  # the column reached `short`: length right more often


@pytest.mark.parametrize("function, message", [
    ("raises", "reward {m}:raises raised KeyError: 'no such thing'"),
    ("too_few", "reward {m}:too_few returned 63 values for 64 completions"),  # the base eval: 16 prompts x 4
    ("nan", "reward {m}:nan returned nan for completion 0: rewards must be finite numbers"),
    ("number", "reward {m}:number returned float 1.0: expected a list of 64 numbers, one per completion"),
])
def test_a_misbehaving_reward_stops_the_run_naming_it_before_any_update(user_files, function, message):
    tmp, module = user_files
    args = small_args(grpo, tmp, task="data", model=grpo.resolve_model("embedded", "reverse"), data_path="rows.jsonl",
                      prompt_column="question", answer_column="target", reward=[f"{module}:{function}"], steps=3,
                      eval_every=0, prompts_per_step=4)
    with pytest.raises(RewardError, match=message.format(m=module).replace("(", r"\(").replace(")", r"\)")):
        grpo.main(args)
    assert not (tmp / "run" / "checkpoints").exists() or not any((tmp / "run" / "checkpoints").glob("step_*"))
    assert not [r for r in read_metrics(tmp / "run") if r["step"] > 0]  # it stopped at the first scoring (the base eval)


def data_flags(module, **overrides) -> dict:
    return {**dict(task="data", model=grpo.resolve_model("embedded", "reverse"), data_path="rows.jsonl",
                   prompt_column="question", answer_column="target", reward=[f"{module}:exact"]), **overrides}


def test_numpy_and_torch_numbers_are_rewards_too(user_files):
    tmp, module = user_files
    grpo.main(small_args(grpo, tmp, **data_flags(module, reward=[f"{module}:numpy_floats", f"{module}:torch_tensor"]),
                         steps=1, eval_every=0, prompts_per_step=4))
    rows = read_metrics(tmp / "run")
    assert rows[1]["reward/numpy_floats"] == 0.25 and rows[1]["reward/torch_tensor"] == 0.5 and rows[1]["reward/mean"] == 0.75


def test_two_rewards_with_one_name_in_two_modules_are_kept_apart_and_logged_by_path(user_files):
    tmp, _ = user_files
    (tmp / "ra.py").write_text(SCORE.format(1.0))
    (tmp / "rb.py").write_text(SCORE.format(0.0))
    grpo.main(small_args(grpo, tmp, **data_flags("ra", reward=["ra:score", "rb:score"]), steps=1, eval_every=0,
                         prompts_per_step=4))
    row = read_metrics(tmp / "run")[1]
    assert row["reward/ra:score"] == 1.0 and row["reward/rb:score"] == 0.0 and row["reward/mean"] == 1.0


# Reward functions named like the totals every script logs (reward/mean, reward/std): 5 and 0.25 a completion.
TOTALS = ("def mean(completions, answers, **columns):\n    return [5.0] * len(completions)\n\n"
          "def std(completions, answers, **columns):\n    return [0.25] * len(completions)\n")


@pytest.mark.parametrize("script", ["grpo", "ppo", "gapo", "is_grpo", "async_grpo"])
def test_a_reward_named_like_a_total_is_logged_by_path_and_never_overwrites_the_total(user_files, script):
    tmp, _ = user_files
    (tmp / "totals.py").write_text(TOTALS)
    module = __import__(script)
    module.main(small_args(module, tmp, **data_flags("totals", reward=["totals:mean", "totals:std"]), steps=1, eval_every=0,
                           prompts_per_step=4))
    row = read_metrics(tmp / "run")[1]
    assert row["reward/totals:mean"] == pytest.approx(5.0) and row["reward/totals:std"] == pytest.approx(0.25)
    # the weighted sum of the two, the same for every completion: a mean of 5.25 and no spread (float32 sums: a tolerance)
    assert row["reward/mean"] == pytest.approx(5.25) and row["reward/std"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (dict(reward=[]), "--task data needs at least one --reward module:function"),
    (dict(reward=["{m}:exact", "{m}:exact"]), "--reward {m}:exact is given twice"),
    (dict(reward_weights=[float("nan")]), "--reward-weights: the weight of {m}:exact is nan; weights must be finite"),
    (dict(reward_weights=[float("inf")]), "--reward-weights: the weight of {m}:exact is inf"),
    (dict(reward=["broken_module:f"]), "--reward broken_module:f: importing broken_module raised ZeroDivisionError"),
    (dict(reward=["nosuchmodule:f"]), "--reward nosuchmodule:f: cannot import nosuchmodule"),
    (dict(reward=["{m}:missing"]), "--reward {m}:missing: {m} has no function missing"),
    (dict(reward=["{m}"]), "--reward {m}: expected module:function"),
    (dict(reward_weights=[1.0, 2.0]), "--reward-weights has 2 values for 1 --reward functions"),
    (dict(prompt_column="prompt"), "rows.jsonl: no column 'prompt' \\(columns: question, target, digits\\)"),
    (dict(eval_fraction=1.5), "--eval-fraction must be in \\(0, 1\\)"),
    (dict(data_path="nope.jsonl"), "--data-path nope.jsonl: no such file"),
    (dict(data_path="rows.txt"), "--data-path rows.txt: expected one of .json, .jsonl, .csv, .parquet"),
])
def test_bad_task_input_is_refused_before_a_model_is_built(user_files, monkeypatch, overrides, message):
    tmp, module = user_files
    (tmp / "rows.txt").write_text("x")
    (tmp / "broken_module.py").write_text("1 / 0\n")
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    flags = data_flags(module)
    flags.update({k: [x.format(m=module) for x in v] if k == "reward" else v for k, v in overrides.items()})
    with pytest.raises(ConfigError, match=message.format(m=module)):
        grpo.main(small_args(grpo, tmp, **flags))


def test_a_bad_row_is_named_by_its_index(user_files):
    tmp, module = user_files
    bad = ROWS[:5] + [{"question": "", "target": "1", "digits": 1}] + ROWS[5:]
    (tmp / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ConfigError, match="bad.jsonl row 5: column 'question' must be non-empty text or chat messages"):
        load_task("data", str(tmp / "bad.jsonl"), None, 128, None, "question", "target", [f"{module}:exact"])


def test_chat_message_prompts_are_rendered_by_the_chat_template(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12>"}]
        ids, mask = encode_prompts(tokenizer, [messages, messages, "34>"], "cpu")
        texts = [tokenizer.decode(i[m.bool()]) for i, m in zip(ids, mask)]
        assert texts == ["q: be brief q: 12> a: ", "q: be brief q: 12> a: ", "q: 34> a: "]
    finally:
        tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat messages need a tokenizer with a chat template"):
        encode_prompts(tokenizer, [messages], "cpu")


# ---------------------------------------------------------------- MATH
@pytest.mark.parametrize("completion, answer, right", [
    ("so the answer is \\boxed{0.5}.", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", True),
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{10\\%}", "10", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("first \\boxed{\\frac{3}{4}}, then the final \\boxed{7}", "7", True),  # the last box counts
    ("\\boxed{6}", "5", False),
    ("the answer is 5", "5", False),  # no box: not in the asked format
    ("\\boxed{\\frac{3}{4}", "\\frac{3}{4}", False),  # unbalanced
])
def test_math_answers_are_compared_as_mathematics(completion, answer, right):
    assert math_reward([completion], [answer]) == [float(right)]


def test_math_verify_scores_in_a_thread_other_than_the_main_one():
    """math-verify's own timeout is signal.alarm, which raises outside the main thread."""
    import threading

    scored = {}
    thread = threading.Thread(target=lambda: scored.update(r=math_reward(["\\boxed{\\frac12}", "\\boxed{3}"], ["0.5", "4"])))
    thread.start()
    thread.join()
    assert scored["r"] == [1.0, 0.0]


def test_async_grpo_scores_boxed_answers_with_math_verify_in_its_generation_thread(user_files):
    import async_grpo

    tmp, module = user_files
    async_grpo.main(small_args(async_grpo, tmp, **data_flags(module, reward=[f"{module}:boxed_math"]), steps=2, eval_every=0,
                               prompts_per_step=4))
    rows = read_metrics(tmp / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["eval/pass@1"] > 0  # some boxed answers verified right


def test_math_rows_take_the_answer_from_the_solutions_last_box(tmp_path):
    rows = [{"problem": f"What is {n}/2?", "solution": f"Halve it: \\boxed{{\\frac{{{n}}}{{2}}}}"} for n in range(1, 9)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task("math", str(tmp_path / "math.jsonl"), eval_fraction=0.25)
    assert task.test["answer"] == ["\\frac{7}{2}", "\\frac{8}{2}"] and task.test["prompt"][0].endswith("within \\boxed{}.")
    assert task.reward(["\\boxed{3.5}", "\\boxed{4}"], task.test["answer"]) == [1.0, 1.0]
    assert task.formatted(["\\boxed{1}", "1"]) == [True, False]
    assert not math.isnan(sum(task.reward(["\\boxed{}"], ["1"])))
