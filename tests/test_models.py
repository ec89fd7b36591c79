"""Loading a model: what load_model sets up besides the weights."""

import subprocess
import sys

import pytest
import torch
from conftest import count_onednn

FAULTS = """
import resource, sys, torch
from common.models import load_model, resolve_model
if sys.argv[1] == "load":
    load_model(resolve_model("embedded", "reverse"))

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**24)  # 64 MB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for _ in range(3):  # the heap grows to its size over the first rounds
    faults()
print(faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_loading_a_model_keeps_freed_memory_for_reuse_instead_of_page_faulting_it_again():
    """After load_model (in a fresh process), a freed 64 MB tensor's memory serves the next one: allocating it again
    costs almost no page faults, where glibc's default (a process that loaded no model) maps a fresh block from the
    OS each time, about 16,384 zeroed 4 KB pages."""
    from common.models import keep_freed_memory

    assert keep_freed_memory()  # glibc on Linux: it applies
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]) for how in ("load", "default")}
    assert faults["load"] < 1000 < 10000 < faults["default"], faults


ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def linear_and_grads(x, layer):
    x = x.detach().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()  # a loss whose gradient differs in every column
    return y.detach(), x.grad, layer.weight.grad.clone(), None if layer.bias is None else layer.bias.grad.clone()


@ONEDNN
@pytest.mark.parametrize("bias", [True, False])
def test_a_linear_layer_through_onednn_computes_torchs_output_and_gradients_up_to_rounding(bias, monkeypatch):
    """y = x W^T + b, dL/dx, dL/dW and dL/db through oneDNN against torch's own linear: float32 rounding apart
    (products of 96 terms, summed in another order), on a batch of sequences and on a non-contiguous input."""
    from common.models import onednn_linears

    calls = count_onednn(monkeypatch)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(96, 80, bias=bias))
    for x in (torch.randn(3, 7, 96), torch.randn(96, 11).t()):
        assert onednn_linears(layer, on=False) == 0
        want = linear_and_grads(x, layer[0])
        assert onednn_linears(layer, on=True) == 1
        got = linear_and_grads(x, layer[0])
        for a, b in zip(got, want):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert got[0].abs().max() > 0.1  # a real product, not zeros
    assert len(calls) == 2 * 3  # each input: the forward and two products in the backward, all through oneDNN


@ONEDNN
def test_a_linear_layer_through_onednn_leaves_what_it_does_not_compute_to_torch():
    """Under bf16 autocast the product is bf16, as torch's linear makes it; an empty batch, a frozen weight (LoRA's
    base: no weight gradient) and no-grad calls all work."""
    from common.models import onednn_linears

    layer = torch.nn.Linear(32, 16)
    onednn_linears(layer, on=True)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    assert layer(torch.randn(0, 32)).shape == (0, 16)
    layer.weight.requires_grad_(False)
    x.requires_grad_()
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, torch.full((16,), 4.0))
    assert layer.weight.grad is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)


@ONEDNN
def test_a_second_derivative_through_onednn_is_torchs():
    """d/dW of |dL/dx|^2 with L = |x W^T + b|^2 (a gradient penalty's shape): create_graph=True records the backward's
    products, which are oneDNN's too, and the result is torch's own linear's up to float32 rounding."""
    from common.models import onednn_linears

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(24, 16), torch.randn(5, 24, requires_grad=True)

    def second_derivative():
        layer.zero_grad()
        (dx,) = torch.autograd.grad((layer(x) ** 2).sum(), x, create_graph=True)
        (dx ** 2).sum().backward()
        return layer.weight.grad.clone()

    onednn_linears(layer, on=False)
    want = second_derivative()
    onednn_linears(layer, on=True)
    torch.testing.assert_close(second_derivative(), want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_pickles_whole_and_loads_back_computing_the_same(dtype, tmp_path, monkeypatch):
    """torch.save(model) of a model as load_model sets it up (its linear layers' forward through oneDNN, the bf16
    autocast on its forward), torch.load back: the same logits, through the same kernels."""
    from common.models import autocast_forward, onednn_linears

    from transformers import LlamaForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    onednn_linears(model, on=torch.backends.mkldnn.is_available())
    autocast_forward(model, dtype)
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    calls = count_onednn(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)
    assert (len(calls) > 0) == (dtype == "float32" and torch.backends.mkldnn.is_available())  # bf16: autocast's products
    assert getattr(loaded, "autocast_dtype", None) == (torch.bfloat16 if dtype == "bfloat16" else None)


def linear_ops(model) -> set[str]:
    from torch.profiler import profile

    with torch.no_grad(), profile() as prof:
        model(input_ids=torch.arange(1, 6)[None])
    return {e.name for e in prof.events()}


@ONEDNN
def test_the_embedded_models_products_stay_torchs_and_the_switch_is_refused_when_misspelt(monkeypatch):
    """The embedded job's tiny products are no faster through oneDNN (measured): its figures stay torch's. A value of
    POSTRL_CPU_MATMUL other than onednn / torch is an error naming it, before any work."""
    from common.cli import ConfigError
    from common.models import load_model, resolve_model

    assert "mkldnn::_linear_pointwise" not in linear_ops(load_model(resolve_model("embedded", "reverse")))
    monkeypatch.setenv("POSTRL_CPU_MATMUL", "mkl")
    with pytest.raises(ConfigError, match=r"^POSTRL_CPU_MATMUL='mkl': choose onednn or torch$"):
        load_model(resolve_model("embedded", "reverse"))


@ONEDNN
@pytest.mark.parametrize("setting", [dict(lora_r=4, lora_alpha=8.0), dict(gradient_checkpointing=True)],
                         ids=["lora", "checkpointing"])
def test_the_training_forwards_gradient_through_onednn_is_torchs_under_lora_and_checkpointing(tokenizer, setting,
                                                                                               monkeypatch):
    """token_logprobs and the gradient of their sum, oneDNN's products against torch's, on the embedded model turned
    to oneDNN by hand (its default is torch's): peft's frozen base layers (no weight gradient, the adapters' gradient
    through them) and the recomputation of checkpointing take the oneDNN path and give torch's numbers."""
    import grpo
    from common.models import load_policy, onednn_linears, resolve_model
    from common.rollout import rollout, token_logprobs
    from common.tasks import load_task

    policy = load_policy(resolve_model("embedded", "reverse"), None, grpo.Args(**setting))
    rows = load_task("reverse", num_test=8).test.select(range(3))
    batch = rollout(policy, tokenizer, [p for p in rows["prompt"] for _ in range(4)], [(2, i) for i in range(12)], 8, 1.0,
                    [tokenizer.eos_token_id], "cpu")
    policy.train()

    def logps_and_grads():
        policy.zero_grad()
        logps, _ = token_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        (logps * batch.completion_mask).sum().backward()
        return logps.detach(), torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])

    own, own_grad = logps_and_grads()
    calls = count_onednn(monkeypatch)
    assert onednn_linears(policy, on=True) > 0
    fast, fast_grad = logps_and_grads()
    assert len(calls) > 0
    torch.testing.assert_close(fast, own, rtol=1e-5, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(fast_grad, own_grad, dim=0) > 0.999999 and own_grad.abs().sum() > 0
