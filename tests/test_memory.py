"""Memory options: micro-batched sampling gives the tokens of one pass, LoRA trains adapters only with the base
as pi_ref (no copy), gradient checkpointing takes the same step, and async_grpo's generator shares LoRA's base."""

import json

import pytest
import torch
from accelerate import Accelerator
from conftest import assert_same_samples, small_args, state_dicts_equal, without_timing
from transformers import LlamaConfig, LlamaForCausalLM

import async_grpo
import gapo
import grpo
import ppo
from common.logging import read_metrics
from common.losses import group_advantages
from common.models import disable_dropout, load_model, load_policy, resolve_model
from common.rollout import checkpoints_activations, rollout, token_logprobs
from common.tasks import load_task

EMBEDDED = resolve_model("embedded", "reverse")


@pytest.mark.parametrize("task_name", ["reverse", "chain-3"])
def test_micro_batched_sampling_gives_the_tokens_of_one_pass_up_to_rounding(tokenizer, task_name):
    """Each row draws its own uniforms, so micro-batches sample what one pass does; a micro-batch pads its prompts to
    its own longest one and runs other matrix shapes, which moves the logits by ~1e-6 (conftest.assert_same_samples)."""
    task = load_task(task_name)
    model = load_model(resolve_model("embedded", task_name))
    prompts = [p for p in task.test["prompt"][:6] for _ in range(4)]  # 24 rows, groups of 4
    answers = [a for a in task.test["answer"][:6] for _ in range(4)]
    keys = [(0, 7, i) for i in range(24)]
    whole = rollout(model, tokenizer, prompts, keys, 8, 1.0, [tokenizer.eos_token_id], "cpu", task.envs(answers))
    for batch_size in (5, 8):  # one that splits groups, one that does not
        parts = rollout(model, tokenizer, prompts, keys, 8, 1.0, [tokenizer.eos_token_id], "cpu", task.envs(answers), batch_size)
        assert_same_samples(model, whole, parts, keys, 8)
        if whole.texts == parts.texts:
            assert task.score(whole, answers) == task.score(parts, answers)


def test_gradient_checkpointing_takes_the_same_step(tokenizer):
    task = load_task("reverse")
    model = load_model(EMBEDDED)
    prompts = [p for p in task.train["prompt"][:8] for _ in range(4)]
    batch = rollout(model, tokenizer, prompts, [(0, i) for i in range(32)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
    advantages = group_advantages(torch.tensor(task.reward(batch.texts, [a for a in task.train["answer"][:8] for _ in range(4)])), 4)
    grads = {}
    for checkpointing in (False, True):
        args = grpo.Args(max_new_tokens=8, beta=0.0, gradient_checkpointing=checkpointing)
        policy = load_policy(EMBEDDED, None, args)
        assert checkpoints_activations(policy) == checkpointing

        class Keep(torch.optim.SGD):  # records the gradient, takes no step
            def step(self, closure=None):
                grads[checkpointing] = [p.grad.clone() for p in policy.parameters()]

        grpo.optimise(policy, None, Keep(policy.parameters(), lr=0.0), Accelerator(cpu=True), batch, advantages, args, step=1)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))


def saved_activation_bytes(policy, batch) -> int:
    """Bytes autograd keeps for the backward pass of one training forward (the activations)."""
    saved = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    return sum(saved)


def test_gradient_checkpointing_keeps_fewer_activations_in_the_state_the_scripts_train_in(tokenizer):
    """After a rollout (which samples in eval mode), the policy is back in training mode, where transformers
    checkpoints; its own dropout is off, so the two modes compute the same log-probs."""
    task = load_task("reverse")
    prompts = [p for p in task.train["prompt"][:8] for _ in range(4)]
    kept = {}
    for checkpointing in (False, True):
        policy = load_policy(EMBEDDED, None, grpo.Args(gradient_checkpointing=checkpointing))
        batch = rollout(policy, tokenizer, prompts, [(0, i) for i in range(32)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
        assert policy.training
        kept[checkpointing] = saved_activation_bytes(policy, batch)
    assert kept[True] < 0.5 * kept[False], kept


def test_the_policy_trains_without_dropout():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, attention_dropout=0.5))
    disable_dropout(model)
    assert all(m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "attention_dropout"))


# ---------------------------------------------------------------- LoRA
LORA = dict(lora_r=4, lora_alpha=8.0, lr=5e-3)


def test_lora_trains_the_adapters_only_and_its_reference_is_the_base(tmp_path):
    grpo.main(small_args(grpo, tmp_path, steps=2, lora_target_modules="q_proj,v_proj", **LORA))
    run = tmp_path / "run"
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    assert set(json.loads((checkpoint / "adapter_config.json").read_text())["target_modules"]) == {"q_proj", "v_proj"}
    rows = read_metrics(run)
    assert rows[1]["policy/kl_ref"] == 0.0  # adapters start at B = 0: pi_theta = pi_ref exactly
    assert rows[2]["policy/kl_ref"] > 0  # after a step they differ
    from peft import PeftModel

    trained = PeftModel.from_pretrained(load_model(EMBEDDED), str(checkpoint))
    base = load_model(EMBEDDED)
    base_weights = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                    for k, v in trained.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_weights[k], v) for k, v in base.state_dict().items())  # the base is untouched
    assert any(v.abs().sum() > 0 for k, v in trained.state_dict().items() if "lora_B" in k)  # the adapters moved


def test_lora_resume_ends_like_an_uninterrupted_run_and_export_merges(tmp_path):
    grpo.main(small_args(grpo, tmp_path / "full", steps=4, save_every=2, export_dtype="float32", **LORA))
    grpo.main(small_args(grpo, tmp_path / "cut", steps=2, save_every=2, **LORA))
    grpo.main(small_args(grpo, tmp_path / "cut", steps=4, save_every=2, resume=str(tmp_path / "cut" / "run"), **LORA))
    assert without_timing(read_metrics(tmp_path / "cut" / "run")) == without_timing(read_metrics(tmp_path / "full" / "run"))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "run" / "export")  # a plain model, no peft
    assert not any("lora" in k for k in merged.state_dict())
    assert not state_dicts_equal(merged, load_model(EMBEDDED))


def tiny_gpt2(tmp_path) -> str:
    """A 2-layer GPT-2 (its attention and MLP are transformers' Conv1D layers, not Linear), saved as a model directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=61, n_positions=64)).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


@pytest.mark.parametrize("model, targets", [("embedded", "self_attn.q_proj,v_proj"), ("gpt2", "c_attn"), ("gpt2", "attn.c_proj")])
def test_lora_targets_are_the_modules_peft_adapts_dotted_suffixes_and_conv1d_included(tmp_path, model, targets):
    """peft's rule for a list of names: a module whose name is the target or ends in '.' + target, of a kind LoRA adapts
    (Linear, Embedding, convolutions, transformers' Conv1D): exactly the modules that get adapters."""
    from peft import LoraConfig, get_peft_model

    path = EMBEDDED if model == "embedded" else tiny_gpt2(tmp_path)
    policy = load_policy(path, None, grpo.Args(lora_r=4, lora_target_modules=targets))
    adapted = {name for name, module in policy.named_modules() if hasattr(module, "lora_A")}
    peft_own = get_peft_model(load_model(path), LoraConfig(r=4, target_modules=targets.split(","), task_type="CAUSAL_LM"))
    assert adapted and adapted == {name for name, module in peft_own.named_modules() if hasattr(module, "lora_A")}


def test_a_lora_target_the_model_lacks_is_one_line_naming_the_layers_it_has(tmp_path):
    from common.cli import ConfigError

    with pytest.raises(ConfigError, match="^--lora-target-modules: the model has no layer LoRA can adapt named nosuch_proj \\(its "
                                          "layers: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
                                          "v_proj, or all-linear\\)$"):
        grpo.main(small_args(grpo, tmp_path, steps=1, lora_target_modules="q_proj,nosuch_proj", **LORA))


@pytest.mark.parametrize("script, truncation", [(grpo, dict(top_p=0.8)), (ppo, dict(top_p=0.8)), (gapo, dict(top_k=3))],
                         ids=["grpo-top_p", "ppo-top_p", "gapo-top_k"])
def test_with_top_p_or_top_k_the_reference_is_scored_under_the_policys_truncation(tmp_path, script, truncation):
    """At equal weights (LoRA's B = 0: the same model, the same kernels, adapters adding exactly 0) the KL to pi_ref is
    exactly 0 under truncation too: both are the truncated distributions, each renormalised, the scored token kept.
    Scoring pi_ref on its full distribution instead gives log(kept mass) per token, > 0 at the first step."""
    extra = dict(prompts_per_step=16, num_generations=1, minibatches=2, ppo_epochs=1) if script is ppo else {}
    extra = dict(beta=0.04) if script is gapo else extra  # (gapo.py's default is 0: no reference)
    script.main(small_args(script, tmp_path, task="add", steps=1, eval_every=0, **truncation, **LORA, **extra))
    assert read_metrics(tmp_path / "run")[1]["policy/kl_ref"] == 0.0


def test_ppo_trains_a_value_head_on_a_lora_policy(tmp_path):
    ppo.main(small_args(ppo, tmp_path, steps=2, prompts_per_step=16, minibatches=2, ppo_epochs=1, **LORA))
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["value/loss"] > 0 and rows[1]["objective/kl_ref"] == 0.0
    assert json.loads((tmp_path / "run" / "args.json").read_text())["lora_r"] == 4


def test_async_generator_shares_the_lora_base_and_holds_its_own_adapters():
    args = async_grpo.Args(**LORA)
    policy = load_policy(EMBEDDED, None, args)
    sampler = async_grpo.generator_copy(policy, "cpu")
    pairs = list(zip(policy.parameters(), sampler.parameters()))
    frozen = [(a, b) for a, b in pairs if not a.requires_grad]
    adapters = [(a, b) for a, b in pairs if a.requires_grad]
    assert frozen and all(a.data_ptr() == b.data_ptr() for a, b in frozen)  # one copy of the base
    assert adapters and all(a.data_ptr() != b.data_ptr() for a, b in adapters)
    snapshot = async_grpo.snapshot(policy)
    assert set(snapshot) == {n for n, p in policy.named_parameters() if p.requires_grad}  # adapters only
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(1.0)
    async_grpo.load_trained(sampler, async_grpo.snapshot(policy))
    assert all(torch.equal(a, b) for a, b in pairs)


def test_async_grpo_runs_with_lora_in_both_modes(tmp_path):
    for mode in ("emulated", "threaded"):
        async_grpo.main(small_args(async_grpo, tmp_path / mode, steps=3, mode=mode, eval_every=0, **LORA))
        rows = read_metrics(tmp_path / mode / "run")
        assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["policy/kl_ref"] > 0


# ---------------------------------------------------------------- sharding
FSDP2_ROLLOUT = """
import sys
import torch.distributed as dist
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from conftest import assert_same_samples
dist.init_process_group("gloo")
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from torch.distributed.fsdp import fully_shard
from common.models import char_tokenizer, load_model, resolve_model
from common.rollout import rollout

tokenizer, path = char_tokenizer(), resolve_model("embedded", "reverse")
whole, sharded = load_model(path), load_model(path)
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded)  # 3 sharded modules: the root and two decoder layers
gathers, all_gather = [], param_group.foreach_all_gather
param_group.foreach_all_gather = lambda *a, **k: (gathers.append(1), all_gather(*a, **k))[1]
prompts, keys = ["123>", "45678>", "9>"], [(0, i) for i in range(3)]
a = rollout(whole, tokenizer, prompts, keys, 8, 1.0, [tokenizer.eos_token_id], "cpu")
b = rollout(sharded, tokenizer, prompts, keys, 8, 1.0, [tokenizer.eos_token_id], "cpu")
assert_same_samples(whole, a, b, keys, 8)  # the same kernels on gathered weights: equal up to rounding
assert len(gathers) == 3, len(gathers)  # once per sharded module for the whole rollout (decoding took several forwards)
assert int(a.completion_mask.sum(-1).max()) > 2
print("ok", dist.get_rank())
"""


def test_fsdp2_sampling_gathers_the_weights_once_per_rollout_and_samples_what_the_whole_model_does(tmp_path):
    """accelerate runs FSDP only on GPUs (with --cpu it falls back to DDP), so this checks postrl's part with torch's
    FSDP2 directly, on two gloo processes: a sharded model samples the unsharded model's tokens (up to rounding), and its
    weights are all-gathered once per module for a rollout, not once per decoded token."""
    from conftest import ROOT, launch_two_processes

    script = tmp_path / "fsdp2_rollout.py"
    script.write_text(FSDP2_ROLLOUT)
    out = launch_two_processes(str(script), str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 2


def test_resuming_an_fsdp_run_is_refused_with_the_reason(tmp_path):
    """The AdamW state of an FSDP run is sharded over its processes; a checkpoint holds the gathered weights only."""
    from types import SimpleNamespace

    from common.checkpoint import find_checkpoint
    from common.cli import ConfigError

    with pytest.raises(ConfigError, match="resuming an FSDP run is not supported .* --model <checkpoint dir>"):
        find_checkpoint(str(tmp_path), SimpleNamespace(distributed_type="FSDP"))
