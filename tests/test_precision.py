"""Precision: --dtype bfloat16 is mixed precision (float32 master weights and AdamW state, bf16 matrix
products), so a small step counts; pure bf16 only by --pure-dtype, with a measured warning."""

import pytest
import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import latest_weights, small_args

import grpo
from common.cli import ConfigError
from common.losses import group_advantages
from common.models import load_model, pure_dtype_warning, resolve_model
from common.rollout import rollout, token_logprobs
from common.tasks import load_task

EMBEDDED = resolve_model("embedded", "reverse")


@pytest.fixture(scope="module")
def batch_and_advantages(tokenizer):
    """One GRPO batch of the embedded job (32 prompts x 8), sampled in float32, and its advantages."""
    task = load_task("reverse")
    model = load_model(EMBEDDED)
    prompts = [p for p in task.train["prompt"][:32] for _ in range(8)]
    answers = [a for a in task.train["answer"][:32] for _ in range(8)]
    batch = rollout(model, tokenizer, prompts, [(0, i) for i in range(256)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
    return batch, group_advantages(torch.tensor(task.reward(batch.texts, answers)), 8)


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps the gradient it stepped on (matrix weights, one float32 vector)."""

    def step(self, closure=None):
        self.gradient = torch.cat([p.grad.float().flatten() for g in self.param_groups for p in g["params"] if p.dim() == 2])
        return super().step(closure)


def one_adamw_step(dtype: str, pure: bool, batch, advantages, lr: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient and the change of every matrix weight in one AdamW step of grpo.py's optimise."""
    policy = load_model(EMBEDDED, dtype, pure=pure)
    before = torch.cat([p.detach().float().flatten() for p in policy.parameters() if p.dim() == 2])
    optimizer = RecordingAdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    grpo.optimise(policy, None, optimizer, Accelerator(cpu=True), batch, advantages, grpo.Args(beta=0.0, max_new_tokens=8), step=1)
    after = torch.cat([p.detach().float().flatten() for p in policy.parameters() if p.dim() == 2])
    return optimizer.gradient, after - before


def test_bf16_mixed_precision_takes_a_1e6_step_as_float32_does_and_pure_bf16_loses_it(batch_and_advantages):
    batch, advantages = batch_and_advantages
    fp32_grad, fp32 = one_adamw_step("float32", False, batch, advantages)
    mixed_grad, mixed = one_adamw_step("bfloat16", False, batch, advantages)
    _, pure = one_adamw_step("bfloat16", True, batch, advantages)
    cosine = torch.nn.functional.cosine_similarity
    moved = fp32 != 0  # the weights the float32 step moves (embedding rows of unused characters get no gradient)
    assert moved.float().mean() > 0.5
    assert (mixed[moved] != 0).float().mean() >= 0.99
    assert cosine(mixed_grad, fp32_grad, dim=0) >= 0.999  # bf16 products, float32 accumulation: the same gradient
    # AdamW's first step is about lr * sign(g): where |g| is near zero, bf16 noise flips the sign (0.5 % of the
    # weights here), which costs the update's cosine more than the gradient's
    assert cosine(mixed, fp32, dim=0) >= 0.98
    assert (pure[moved] != 0).float().mean() < 0.05  # the defect --pure-dtype opts into: most steps round away


def test_the_pure_dtype_warning_measures_the_share_of_weights_a_step_cannot_move():
    torch.manual_seed(0)
    layer = torch.nn.Linear(1000, 1000, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    assert "98.1 % of the trained matrix weights" in pure_dtype_warning(layer, 1e-6, "bfloat16")
    # and what it predicts is what an AdamW step does: 10 steps at lr 1e-6 move about 2 % of the weights
    w0 = layer.weight.detach().clone()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-6, weight_decay=0.0)
    for _ in range(10):
        layer(torch.randn(8, 1000, dtype=torch.bfloat16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert (layer.weight != w0).float().mean().item() == pytest.approx(0.019, abs=0.01)


def test_lora_with_pure_dtype_holds_the_frozen_base_in_bf16_and_trains_float32_adapters():
    """The memory-saving LoRA set-up: the base at 2 bytes a weight, the adapters (peft's default) float32, so the
    warning about steps rounding away does not apply and says so."""
    from common.models import load_policy

    policy = load_policy(EMBEDDED, None, grpo.Args(dtype="bfloat16", pure_dtype=True, lora_r=4, lora_alpha=8.0))
    assert {(p.dtype, p.requires_grad) for p in policy.parameters()} == {(torch.bfloat16, False), (torch.float32, True)}
    assert pure_dtype_warning(policy, 1e-6, "bfloat16").startswith("note: --pure-dtype: the frozen weights are held in bfloat16")


def test_sampler_and_training_forward_agree_under_bf16(tokenizer):
    """The behaviour log-probs recorded while sampling (KV cache, one token at a time) and the training forward
    (the whole sequence at once) under bf16 autocast: their first-pass ratio is 1 to within 1e-2."""
    model = load_model(EMBEDDED, "bfloat16")
    prompts = [p for p in load_task("reverse").test["prompt"][:16] for _ in range(4)]
    out = rollout(model, tokenizer, prompts, [(1, i) for i in range(64)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
    with torch.no_grad():
        logps, _ = token_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    m = out.completion_mask.bool()
    ratio = torch.exp(logps[m] - out.logprobs[m])
    assert abs(ratio.mean().item() - 1) < 1e-2 and ratio.max().item() < 1.1


class KernelLog(TorchDispatchMode):
    """Every aten operator a forward runs, in order, with the shapes, strides and dtypes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.detach.default:  # autograd's bookkeeping for the tensors it saves: no arithmetic
            tensors = [(tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((str(func), tensors))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reference_runs_the_policys_kernels_on_the_same_numbers(tokenizer, dtype):
    """pi_ref (frozen: no gradient, eval mode) and the policy (training mode, weights that require a gradient) at equal
    weights call the same operators on tensors of the same shapes, strides and dtypes, so they compute the same
    log-probs and KL(pi_theta || pi_ref) starts at 0 up to a matrix library's own run-to-run determinism. (Before the
    fix the output layer ran mm for one and bmm for the other: torch.matmul chooses by requires_grad on a
    non-contiguous input, and the two rounded differently on some CPUs.)"""
    from common.models import load_policy, load_reference

    args = grpo.Args(dtype=dtype)
    policy, ref = load_policy(EMBEDDED, None, args), load_reference(EMBEDDED, args)
    batch = rollout(policy, tokenizer, ["123>", "4567>"] * 2, [(0, i) for i in range(4)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    with KernelLog() as policy_kernels:
        logps, _ = token_logprobs(policy, *inputs)
    with torch.no_grad(), KernelLog() as ref_kernels:
        ref_logps, _ = token_logprobs(ref, *inputs)
    assert policy.training and not ref.training and logps.requires_grad
    assert policy_kernels.calls == ref_kernels.calls
    assert torch.allclose(logps, ref_logps, rtol=0, atol=1e-6)


def test_a_bf16_run_starts_at_kl_ref_0_checkpoints_float32_weights_and_exports_bf16(tmp_path):
    grpo.main(small_args(grpo, tmp_path, steps=2, dtype="bfloat16", export_dtype="bfloat16", eval_every=0))
    from transformers import AutoModelForCausalLM

    from common.logging import read_metrics

    # pi_ref computed as the policy is, also in bf16 (the same kernels, test above): 0 up to the matrix library
    assert read_metrics(tmp_path / "run")[1]["policy/kl_ref"] == pytest.approx(0.0, abs=1e-9)

    checkpoint = latest_weights(tmp_path / "run")  # loads in the stored dtype
    assert {p.dtype for p in checkpoint.parameters()} == {torch.float32}
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype="auto")
    assert {p.dtype for p in export.parameters()} == {torch.bfloat16}
    for a, b in zip(checkpoint.parameters(), export.parameters()):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach())


@pytest.mark.parametrize("overrides, message", [
    (dict(dtype="float16"), "--dtype float16 is not supported: fp16 training needs loss scaling"),
    (dict(pure_dtype=True), "--pure-dtype needs --dtype bfloat16"),
])
def test_unsupported_precision_is_refused_before_a_model_is_built(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=message):
        grpo.main(small_args(grpo, tmp_path, **overrides))
