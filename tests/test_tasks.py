"""Tasks and rewards: GSM8K answer extraction, data-file checks, the embedded tasks."""

import json
from decimal import Decimal

import pytest

from common.cli import ConfigError
from common.tasks import (digit_match_reward, exact_match_reward, extract_number, gsm8k_reward, gsm8k_steps_reward,
                          intermediate_results, load_task)

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs $1,250 and a cap $250. Total?", "answer": "1250 + 250 = 1500\n#### 1,500"},
    {"question": "Half of 7?", "answer": "#### 3.5"},
    {"question": "Temperature drops from 2 by 5?", "answer": "#### -3"},
]


@pytest.mark.parametrize("completion, answer, reward", [
    ("so the answer is #### 42", "#### 42", 1.0),
    ("#### 42.", "42", 1.0),                               # trailing full stop
    ("the total is 1,234 dollars", "#### 1234", 1.0),     # comma in thousands, last number
    ("#### $1,234,567", "1234567", 1.0),                  # dollar sign and two commas
    ("she pays 3.50", "#### 3.5", 1.0),                   # 3.50 == 3.5
    ("#### -7", "#### -7", 1.0),                          # sign
    ("#### 7", "#### -7", 0.0),
    ("first 12, then 5 #### 12 and 99", "12", 1.0),       # the number right after the last ####
    ("12 apples, then 5 more", "#### 12", 0.0),           # no ####: the last number counts
    ("no number at all", "#### 3", 0.0),
    ("#### 0.5", ".5", 1.0),
    ("#### 41.99", "#### 42", 0.0),
])
def test_gsm8k_reward_on_tricky_answers(completion, answer, reward):
    assert gsm8k_reward([completion], [answer]) == [reward]


def test_extract_number_prefers_the_final_answer_marker():
    assert extract_number("3 + 4 = 7\n#### 7") == Decimal(7)
    assert extract_number("nothing") is None


THREE_STEPS = "The oranges cost 5 x 9 = 45 dollars.\nWith the bag: 45 + 4 = 49 dollars.\nChange: 52 - 49 = 3 dollars.\n#### 3"


def test_intermediate_results_are_the_step_results_before_the_final_answer():
    assert intermediate_results(THREE_STEPS) == [45, 49]
    assert intermediate_results("She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72") == [24]
    assert intermediate_results("Each gets 40 / 5 = 8 apples.\n#### 8") == []
    assert intermediate_results("#### 3.5") == []


@pytest.mark.parametrize("completion, reward", [
    ("5 x 9 = 45, 45 + 4 = 49, 52 - 49 = 3 #### 3", 1.0),
    ("45 and then 49.0 #### 7", 1.0),                     # partial credit does not need the final answer; 49.0 == 49
    ("5 x 9 = 45, so #### 3", 0.5),                       # the first of two intermediate results
    ("it costs 49 #### 3", 0.0),                          # in order: the second without the first earns nothing
    ("#### 3", 0.0),
])
def test_the_steps_reward_gives_the_share_of_intermediate_results_reached_in_order(completion, reward):
    assert gsm8k_steps_reward([completion], ["3"], solution=[THREE_STEPS]) == [reward]


def test_the_steps_reward_is_constant_on_one_step_problems():
    """No intermediate result: 0 for every completion, so it changes no advantage within a group."""
    assert gsm8k_steps_reward(["40 / 5 = 8 #### 8", "#### 9", ""], ["8"] * 3, solution=["Each gets 40 / 5 = 8 apples.\n#### 8"] * 3) == [0.0] * 3


def test_the_steps_reward_reads_the_worked_solution_of_a_gsm8k_file(tmp_path):
    """The gsm8k task keeps each row's worked answer as a `solution` column, which reward functions receive."""
    from types import SimpleNamespace

    rows = [{"question": "Sam buys 5 oranges at 9 dollars each and a bag for 4 dollars, paying with 52 dollars. Change?",
             "answer": THREE_STEPS}] * 2
    task = load_task("gsm8k", write(tmp_path, "g.jsonl", rows), num_test=1, rewards=[
        "common.tasks:gsm8k_reward", "common.tasks:gsm8k_steps_reward"], reward_weights=[1.0, 0.5])
    parts = {}
    texts = ["5 x 9 = 45; 45 + 4 = 49; #### 3", "5 x 9 = 45 #### 2"]
    rewards, _ = task.score(SimpleNamespace(texts=texts, rewards=None), ["3"] * 2, task.train.select([0]), parts)
    assert task.train[0]["answer"] == "3" and parts["gsm8k_steps_reward"] == [1.0, 0.5]
    assert rewards == pytest.approx([1.5, 0.25])


def test_exact_match_and_digit_match_rewards():
    assert exact_match_reward(["321", " 321 ", "32"], ["321"] * 3) == [1.0, 1.0, 0.0]
    # digits aligned on the units: "135" vs "132" -> 2 of 3; "32" vs "132" -> 2 of 3; "1132" vs "132" -> 3 of 4
    assert digit_match_reward(["135", "32", "1132", "132", ""], ["132"] * 5) == pytest.approx([2 / 3, 2 / 3, 3 / 4, 1.0, 0.0])


def write(tmp_path, name, rows, jsonl=True):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows))
    return str(path)


def test_the_format_reward_shapes_gsm8k_scoring_when_weighted_beside_it(tmp_path):
    """--reward common.tasks:gsm8k_reward common.tasks:gsm8k_format_reward --reward-weights 1 0.2: a right answer after
    '####' scores 1.2, a wrong one 0.2, a right last number without the marker 1 (gsm8k_reward reads the last number
    then): the shaping rewards the format only."""
    from types import SimpleNamespace

    task = load_task("gsm8k", write(tmp_path, "g.jsonl", GSM8K_ROWS), num_test=2, rewards=[
        "common.tasks:gsm8k_reward", "common.tasks:gsm8k_format_reward"], reward_weights=[1.0, 0.2])
    texts = ["3 + 4 = 7\n#### 7", "#### 8", "the answer is 7"]
    parts = {}
    rewards, successes = task.score(SimpleNamespace(texts=texts, rewards=None), ["7"] * 3, task.train.select([0]), parts)
    assert rewards == pytest.approx([1.2, 0.2, 1.0]) and successes == [True, False, True]
    assert parts == {"gsm8k_reward": [1.0, 0.0, 1.0], "gsm8k_format_reward": [1.0, 1.0, 0.0]}


def test_extra_held_out_files_are_read_as_the_eval_file_is_and_named_by_their_file(tmp_path):
    train, test = write(tmp_path, "g.jsonl", GSM8K_ROWS), write(tmp_path, "t.jsonl", GSM8K_ROWS[:2])
    transfer = write(tmp_path, "transfer.jsonl", GSM8K_ROWS[2:])
    task = load_task("gsm8k", train, test, extra_eval_paths=[transfer])
    assert list(task.extra_tests) == ["transfer"] and task.extra_tests["transfer"]["answer"] == ["3.5", "-3"]
    with pytest.raises(ConfigError, match="--extra-eval-data-path is for --task gsm8k, gsm8k-turns, math or data"):
        load_task("reverse", extra_eval_paths=[transfer])
    with pytest.raises(ConfigError, match="two files are named transfer"):
        load_task("gsm8k", train, test, extra_eval_paths=[transfer, transfer])


def test_gsm8k_from_a_local_jsonl_file_holds_out_the_last_rows(tmp_path):
    task = load_task("gsm8k", write(tmp_path, "g.jsonl", GSM8K_ROWS), num_test=2)
    assert len(task.train) == 2 and len(task.test) == 2
    assert task.train[0]["prompt"].startswith("Tom has 3 apples") and task.train[0]["answer"] == "7"
    assert task.train[1]["answer"] == "1500"
    assert task.reward(["... #### 3.50"], [task.test[0]["answer"]]) == [1.0]


def test_gsm8k_from_a_json_file_with_a_separate_eval_file(tmp_path):
    train = write(tmp_path, "train.json", GSM8K_ROWS, jsonl=False)
    test = write(tmp_path, "test.json", GSM8K_ROWS[:1], jsonl=False)
    task = load_task("gsm8k", train, test)
    assert len(task.train) == 4 and len(task.test) == 1


@pytest.mark.parametrize("bad_row, message", [
    ({"answer": "#### 3"}, "row 2: needs a non-empty string field 'question'"),
    ({"question": "Q?"}, "row 2: field 'answer' must contain a final number"),
    ({"question": "Q?", "answer": "no number"}, "row 2: field 'answer' must contain a final number"),
    ("just a string", "row 2: expected an object"),
])
def test_a_bad_row_is_named(tmp_path, bad_row, message):
    rows = GSM8K_ROWS[:2] + [bad_row] + GSM8K_ROWS[2:]
    with pytest.raises(ConfigError, match=message):
        load_task("gsm8k", write(tmp_path, "bad.jsonl", rows))


def test_broken_json_line_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match="line 2: not valid JSON"):
        load_task("gsm8k", str(path))


def test_unknown_task_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="--task 'sort' is not one of"):
        load_task("sort")
    with pytest.raises(ConfigError, match="--data-path .*no such file"):
        load_task("gsm8k", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="only used with --task gsm8k"):
        load_task("reverse", str(tmp_path / "x.jsonl"))


@pytest.mark.parametrize("name", ["reverse", "add"])
def test_embedded_tasks_are_fixed_and_held_out(name):
    a, b = load_task(name), load_task(name)
    assert a.test["prompt"] == b.test["prompt"] and a.train["prompt"][:50] == b.train["prompt"][:50]
    assert not set(a.test["prompt"]) & set(a.train["prompt"])
    assert a.reward(a.test["answer"][:5], a.test["answer"][:5]) == [1.0] * 5


def test_train_size_keeps_the_first_prompts_and_is_checked():
    assert load_task("reverse", train_size=16).train["prompt"] == load_task("reverse").train["prompt"][:16]
    with pytest.raises(ConfigError, match="--train-size must be in"):
        load_task("reverse", train_size=0)
