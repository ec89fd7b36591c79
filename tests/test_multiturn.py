"""Multi-turn trajectories: model turns and environment observations interleaved in one sequence."""

from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_samples, latest_weights, small_args
from transformers.modeling_outputs import CausalLMOutputWithPast

import async_grpo
import gapo
import grpo
import is_grpo
import ppo
from common import word_problems
from common.cli import ConfigError
from common.logging import read_metrics
from common.models import char_tokenizer
from common.multiturn import chat_observations, turn_metrics, turn_stats
from common.rollout import rollout, select_rows, token_logprobs
from common.tasks import (GSM8K_INSTRUCTION, LAST_TURN, NEXT_TURN, TURNS_INSTRUCTION, ChainEnv, StepsEnv, load_task, running_sums,
                          step_results)

EOS = 2


class ScriptedModel(torch.nn.Module):
    """A 'model' that answers each chain turn with script[k] (k = turns so far), then EOS: its logits put
    all mass on the scripted token. The cache is the context itself, so rollout.sample runs unchanged."""

    def __init__(self, tokenizer, script: list[str]):
        super().__init__()
        self.tokenizer, self.script = tokenizer, script
        self.generation_config = None

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None):
        context = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], dim=1)
        logits = torch.full((*input_ids.shape, len(self.tokenizer)), -1e4)
        for b, row in enumerate(context.tolist()):
            turns = row.count(EOS)
            answered = row[-1] not in self.tokenizer.convert_tokens_to_ids(["="])  # the turn's digit is out
            nxt = EOS if answered else self.tokenizer.convert_tokens_to_ids(self.script[turns])
            logits[b, -1, nxt] = 0.0
        return CausalLMOutputWithPast(logits=logits, past_key_values=context)


def scripted_rollout(tokenizer, task_name, operands, script):
    task = load_task(task_name, num_test=4)
    prompt = f"{operands[0]}+{operands[1]}="
    return rollout(ScriptedModel(tokenizer, script), tokenizer, [prompt], [(0,)], 3, 0.0, [EOS], "cpu",
                   task.envs([operands]))


@pytest.mark.parametrize("reward, expected", [
    ("outcome", [0.0, 0.0, 1.0]),              # paid at the last turn only, if the final sum is right
    ("partial", [1 / 3, 0.0, 1 / 3]),          # 1/N per turn whose running sum is right
    ("sum", [1 / 3, 0.0, 1 + 1 / 3]),
])
def test_rewards_per_step_on_a_scripted_trajectory(tokenizer, reward, expected):
    # operands 4 3 5 9: running sums 7 2 1. The script errs on turn 2 ("3") and recovers by chance on turn 3.
    name = "chain-3" if reward == "outcome" else f"chain-3-{reward}"
    batch = scripted_rollout(tokenizer, name, "4359", ["7", "3", "1"])
    assert batch.turn_texts == [["7", "3", "1"]]
    assert batch.turn_rewards[0] == pytest.approx(expected)
    assert batch.rewards[0] == pytest.approx(sum(expected))
    assert batch.successes == [True] and batch.finished.tolist() == [True]
    # the whole sequence after the prompt: 7<eos>+5=3<eos>+9=1<eos>
    assert batch.completion_ids[0].tolist() == tokenizer.convert_tokens_to_ids(list("7")) + [EOS] + \
        tokenizer.convert_tokens_to_ids(list("+5=3")) + [EOS] + tokenizer.convert_tokens_to_ids(list("+9=1")) + [EOS]


def test_chain_env_success_is_the_final_sum_whatever_the_reward():
    env = ChainEnv("4359", reward="partial")
    assert env.reset("4+3=") == "4+3=" and running_sums("4359") == ["7", "2", "1"]
    assert env.step("7") == ("+5=", pytest.approx(1 / 3), False)
    assert env.step(" 2 ") == ("+9=", pytest.approx(1 / 3), False)
    assert env.step("0") == ("", 0.0, True) and not env.success


def test_training_mask_covers_exactly_the_model_tokens(tiny_model, tokenizer):
    task = load_task("chain-4", num_test=8)
    rows = task.test.select(range(8))
    batch = rollout(tiny_model, tokenizer, rows["prompt"], [(3, i) for i in range(8)], 3, 1.0, [EOS], "cpu",
                    task.envs(rows["answer"]))
    for b, operands in enumerate(rows["answer"]):
        n = int(batch.attention_mask[b].sum())
        assert batch.attention_mask[b, :n].all() and not batch.attention_mask[b, n:].any()  # no holes, pad after
        ids, mask, turn = batch.completion_ids[b, :n], batch.completion_mask[b, :n].bool(), batch.turn_ids[b, :n]
        # the model's tokens, turn by turn, are exactly what it said; everything else is the env's observations
        for k, text in enumerate(batch.turn_texts[b]):
            assert tokenizer.decode(ids[turn == k], skip_special_tokens=True) == text
        turns = len(batch.turn_texts[b])
        observations = "".join(f"+{d}=" for d in operands[2 : turns + 1])
        assert tokenizer.decode(ids[~mask]) == observations
        assert (mask == (turn >= 0)).all() and (batch.logprobs[b, :n][~mask] == 0).all()
        assert not batch.completion_mask[b, n:].any()


def test_logprobs_recomputed_over_the_interleaved_sequence_equal_those_recorded(tiny_model, tokenizer):
    task = load_task("chain-6", num_test=8)
    rows = task.test.select(range(8))
    batch = rollout(tiny_model, tokenizer, rows["prompt"], [(5, i) for i in range(8)], 3, 1.0, [EOS], "cpu",
                    task.envs(rows["answer"]))
    assert (batch.attention_mask.sum(-1) > batch.completion_mask.sum(-1)).all()  # observations are in there
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        logps, _ = token_logprobs(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.attention_mask)
        hidden, _ = token_logprobs(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    assert torch.allclose(logps[mask], batch.logprobs[mask], atol=1e-5)
    # attending with the training mask (observations hidden) scores the tokens in another context
    assert (hidden[mask] - batch.logprobs[mask]).abs().max() > 1e-3


def test_a_trajectory_depends_on_its_key_not_on_its_batch(tiny_model, tokenizer):
    task = load_task("chain-4", num_test=8)
    rows = task.test.select(range(4))
    keys = [(9, i) for i in range(4)]
    batch = rollout(tiny_model, tokenizer, rows["prompt"], keys, 3, 1.0, [EOS], "cpu", task.envs(rows["answer"]))
    alone = rollout(tiny_model, tokenizer, rows["prompt"][2:3], keys[2:3], 3, 1.0, [EOS], "cpu", task.envs(rows["answer"][2:3]))
    assert_same_samples(tiny_model, select_rows(batch, [2]), alone, keys[2:3], 3)  # up to rounding (conftest)
    if batch.texts[2] == alone.texts[0]:
        assert batch.turn_rewards[2] == alone.turn_rewards[0]


def test_turn_and_token_budgets_end_a_trajectory(tokenizer):
    class ShortBudget(ChainEnv):
        max_tokens = 6  # "7<eos>+5=" is 5 tokens: the second turn is cut after 1 token

    batch = rollout(ScriptedModel(tokenizer, ["7", "2", "1"]), tokenizer, ["4+3="], [(0,)], 3, 0.0, [EOS], "cpu",
                    [ShortBudget("4359")])
    assert batch.completion_ids[0].tolist() == tokenizer.convert_tokens_to_ids(list("7")) + [EOS] + \
        tokenizer.convert_tokens_to_ids(list("+5=2"))
    assert batch.turn_texts == [["7", "2"]] and batch.finished.tolist() == [False] and batch.successes == [False]
    assert batch.completion_mask[0].tolist() == [1, 1, 0, 0, 0, 1]


def test_a_model_turn_cut_at_its_budget_leaves_the_trajectory_unfinished(tokenizer):
    """finished reads as in a single-turn rollout (every model turn ended with EOS; completions/clipped_frac counts the
    rest as cut at --max-new-tokens), apart from done: the environment took its last turn."""
    script = ["7", "2", "1"]  # each turn is its digit then EOS: 2 tokens
    cut = rollout(ScriptedModel(tokenizer, script), tokenizer, ["4+3="], [(0,)], 1, 0.0, [EOS], "cpu", [ChainEnv("4359")])
    whole = rollout(ScriptedModel(tokenizer, script), tokenizer, ["4+3="], [(0,)], 2, 0.0, [EOS], "cpu", [ChainEnv("4359")])
    assert len(cut.turn_texts[0]) == len(whole.turn_texts[0]) == 3  # three model turns each (cut: no EOS, "7" again)
    assert cut.done == whole.done == [True]
    assert cut.finished.tolist() == [False] and whole.finished.tolist() == [True]


def test_a_last_turn_cut_by_the_trajectory_budget_is_done_not_finished_through_a_split_batch(tokenizer):
    class Tight(ChainEnv):
        max_tokens = 11  # "7<eos>+5=2<eos>+9=" is 10 tokens: the last turn keeps its "1", not its EOS

    batch = rollout(ScriptedModel(tokenizer, ["7", "2", "1"]), tokenizer, ["4+3="] * 2, [(0,), (1,)], 2, 0.0, [EOS], "cpu",
                    [ChainEnv("4359"), Tight("4359")], batch_size=1)  # two sampling calls, concatenated
    assert batch.turn_texts == [["7", "2", "1"]] * 2 and batch.successes == [True, True]
    assert batch.done == [True, True] and batch.finished.tolist() == [True, False]


def test_by_turn_statistics_add_up_over_micro_batches():
    ratio = torch.tensor([[1.0, 1.2, 1.0, 0.5], [0.9, 1.0, 1.4, 1.0]])
    clipped = ratio > 1.3
    turn_ids = torch.tensor([[0, 0, -1, 1], [0, -1, 1, -1]])
    whole = turn_stats(ratio, clipped, turn_ids, 3)
    assert torch.equal(whole, turn_stats(ratio[:1], clipped[:1], turn_ids[:1], 3) + turn_stats(ratio[1:], clipped[1:], turn_ids[1:], 3))
    metrics = turn_metrics(whole)
    assert metrics["turns/clip_frac_t1"] == 0 and metrics["turns/clip_frac_t2"] == 0.5
    assert metrics["turns/ratio_std_t2"] == pytest.approx(torch.tensor([0.5, 1.4]).std(unbiased=False).item())
    assert "turns/clip_frac_t3" not in metrics  # no tokens at turn 3


# ---------------------------------------------------------------- word problems, one step a turn (gsm8k-turns)
def test_word_problem_env_asks_each_step_then_the_final_answer_and_credits_each_turn():
    env = StepsEnv("The flowers cost 5 x 6 = 30 dollars.\nWith the bag: 30 + 6 = 36 dollars.\nChange: 54 - 36 = 18 dollars.\n#### 18")
    assert env.max_turns == 3 and env.reset("Q") == "Q"
    assert env.step("5 x 6 = 30") == (NEXT_TURN, pytest.approx(1 / 3), False)  # the number the turn gives: its last
    assert env.step("36 dollars, I think? No: 37") == (LAST_TURN, 0.0, False)  # wrong step: no credit, asked on
    assert env.step("The change is 18.\n#### 18") == ("", pytest.approx(1 / 3), True) and env.success
    one = StepsEnv("Maria has 12 + 17 = 29 coins.\n#### 29")  # one step: one turn, the final answer
    assert one.max_turns == 1 and one.step("#### 30") == ("", 0.0, True) and not one.success


def test_each_line_is_a_turn_even_when_its_result_repeats_or_equals_the_final_answer():
    # 18, 25, 18 with final 18: turn 1 asks for 18, turn 2 for 25, the last for the final 18
    assert step_results("a: 3 x 6 = 18.\nb: 18 + 7 = 25.\nc: 25 - 7 = 18.\n#### 18") == [18, 25]
    assert step_results("a: 2 x 5 = 10.\nb: 10 + 2 = 12.\nc: 12 x 1 = 12.\nd: 12 + 3 = 15.\n#### 15") == [10, 12, 12]
    assert step_results("Natalia sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72") == [24]
    env = StepsEnv("a: 3 x 6 = 18.\nb: 18 + 7 = 25.\nc: 25 - 7 = 18.\n#### 18")
    assert [env.step(x)[1] for x in ("18", "25", "#### 18")] == pytest.approx([1 / 3] * 3) and env.success


def test_gsm8k_turns_serves_its_rows_one_step_a_turn_and_its_extra_sets_single_turn(problems):
    train, test, transfer = problems
    task = load_task("gsm8k-turns", train, test, num_test=16, extra_eval_paths=[transfer])
    single = load_task("gsm8k", train, test, num_test=16)
    steps = [len(word_problems.solution_steps(a)) for a in single.test["solution"]]
    many, one = steps.index(max(steps)), steps.index(1)
    assert max(steps) > 1 and task.test[many]["answer"] == single.test[many]["solution"]
    assert task.test[many]["prompt"] == single.test[many]["prompt"].removesuffix(GSM8K_INSTRUCTION) + TURNS_INSTRUCTION
    assert task.test[one]["prompt"] == single.test[one]["prompt"]  # one step: the single-turn prompt
    assert [e.max_turns for e in task.envs(task.test["answer"])] == steps
    assert task.envs(task.extra_tests["transfer"]["answer"]) is None  # final numbers: single-turn, scored by gsm8k_reward
    assert task.extra_tests["transfer"]["prompt"] == load_task("gsm8k", train, transfer, num_test=16).test["prompt"]


def test_gsm8k_turns_refuses_a_row_without_a_worked_answer(tmp_path, problems):
    bad = tmp_path / "test.jsonl"
    bad.write_text('{"question": "q1", "answer": "1 + 1 = 2.\\n#### 2"}\n{"question": "q2", "answer": "42"}\n')
    with pytest.raises(ConfigError, match=r"test.jsonl row 1: --task gsm8k-turns needs a worked answer"):
        load_task("gsm8k-turns", problems[0], str(bad))


def test_a_trajectory_is_formatted_by_its_last_turn_once_asked_for_the_final_answer(problems):
    """The observation asking for the final answer itself contains '####': the trajectory's text would count."""
    task = load_task("gsm8k-turns", *problems[:2])
    batch = SimpleNamespace(texts=[f"30{LAST_TURN}18", f"30{LAST_TURN}#### 18", f"30{LAST_TURN}#### 18"],
                            turn_texts=[["30", "18"], ["30", "#### 18"], ["30", "#### 18"]],
                            done=[True, True, False])
    assert task.formatted(batch.texts) == [True, True, True]  # what the whole text would have said
    assert task.formatted_rows(batch) == [False, True, False]


def test_a_chat_template_that_rewrites_earlier_turns_is_refused():
    """Observations are appended token by token: a template that renders an earlier turn differently once a later one
    follows (here: earlier assistant turns dropped) cannot be continued, and is refused in one line."""
    tokenizer = char_tokenizer()  # its own: the session's tokenizer fixture must keep no template
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'user' or loop.last %}{{ m.content }}|{% endif %}"
                               "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(ConfigError, match="rewrites earlier turns"):
        chat_observations(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}.{% endfor %}{% if add_generation_prompt %}!{% endif %}"
    assert chat_observations(tokenizer)("next", ".") == "<user>next.!"  # the model's turn ended on its end text


def test_bad_chain_names_are_refused():
    with pytest.raises(ConfigError, match=r"number of turns must be in \[2, 16\]"):
        load_task("chain-1")
    with pytest.raises(ConfigError, match="is not one of"):
        load_task("chain-4-dense")


# ---------------------------------------------------------------- the scripts run it by --task, in their own loop
@pytest.mark.parametrize("script", [grpo, gapo, is_grpo, async_grpo], ids=lambda m: m.__name__)
def test_scripts_train_on_a_multi_turn_task_and_log_by_turn(tmp_path, script):
    extra = {"mode": "emulated", "max_staleness": 1} if script is async_grpo else {}
    script.main(small_args(script, tmp_path, task="chain-3-partial", steps=2, num_iterations=2, **extra))
    rows = read_metrics(tmp_path / "run")
    step = rows[-1]
    assert step["trajectory/turns"] == 3 and step["trajectory/model_tokens"] == pytest.approx(6, abs=0.5)
    assert step["trajectory/tokens"] == pytest.approx(step["trajectory/model_tokens"] + 6)  # two observations "+d="
    assert {f"turns/clip_frac_t{k}" for k in (1, 2, 3)} <= step.keys() and "turns/clip_frac_t4" not in step
    assert max(step[f"turns/ratio_std_t{k}"] for k in (1, 2, 3)) > 0  # the second pass moved the ratios
    assert 0 <= step["reward/mean"] <= 1 and 0 <= rows[0]["eval/pass@1"] <= 1
    assert latest_weights(tmp_path / "run").config.num_hidden_layers == 2


def test_ppo_refuses_a_multi_turn_task_before_building_a_model(tmp_path, monkeypatch):
    monkeypatch.setattr(ppo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match="--task chain-4 is multi-turn: ppo.py"):
        ppo.main(small_args(ppo, tmp_path, task="chain-4"))
