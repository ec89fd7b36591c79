"""The embedded default: character tokenizer, deterministic warm start, shipped base models."""

import pytest
from conftest import state_dicts_equal

from common.cli import ConfigError
from common.embedded import build
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.rollout import evaluate
from common.tasks import load_task


def test_character_tokenizer_round_trips_and_pads_left(tokenizer):
    ids = tokenizer("40213>", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tokenizer.decode(ids) == "40213>"
    batch = tokenizer(["1>", "123>"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2 and batch["attention_mask"][0] == [0, 0, 1, 1]


def test_warm_start_build_is_deterministic_and_loads_with_from_pretrained(tmp_path):
    build("reverse", tmp_path / "a", steps=3)
    build("reverse", tmp_path / "b", steps=3)
    a, b = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "b"))
    assert state_dicts_equal(a, b)
    assert load_tokenizer(str(tmp_path / "a")).decode([4, 5]) == "01"


def test_embedded_resolves_only_for_embedded_tasks():
    assert resolve_model("embedded", "reverse").endswith("weights/reverse")
    assert resolve_model("embedded", "chain-8-partial").endswith("weights/chain")  # one model for every chain-N
    assert resolve_model(resolve_model("embedded", "add"), "gsm8k").endswith("weights/add")  # a local model directory
    with pytest.raises(ConfigError, match="--task gsm8k has no embedded model"):
        resolve_model("embedded", "gsm8k")


@pytest.mark.parametrize("task, pass1_range", [("reverse", (0.08, 0.3)), ("reverse-long", (0.03, 0.15)), ("add", (0.15, 0.4)),
                                              ("chain-4", (0.2, 0.45))])
def test_shipped_base_models_are_right_some_but_not_most_of_the_time(task, pass1_range):
    """The base policy RL starts from: sampled pass@1 well under 1, greedy and pass@8 well over it."""
    path = resolve_model("embedded", task)
    model, tokenizer = load_model(path), load_tokenizer(path)
    held_out = load_task(task, num_test=64)
    metrics = evaluate(model, tokenizer, held_out, n=8, k=8, max_new_tokens=held_out.max_new_tokens, temperature=1.0,
                       eos_ids=eos_token_ids(model, tokenizer), device="cpu", seed=0)
    low, high = pass1_range
    assert low <= metrics["eval/pass@1"] <= high, metrics
    assert metrics["eval/pass@k"] >= 2 * metrics["eval/pass@1"]
    assert model.num_parameters() < 200_000 and model.config.num_hidden_layers == 2
