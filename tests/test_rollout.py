"""Sampling and scoring: masks, log-probs, reproducible noise, pass@k."""

import math
from pathlib import Path

import pytest
import torch
from conftest import CHAT_TEMPLATE, assert_same_samples

from common.rollout import concat_rollouts, model_digest, pass_at_k, rollout, select_rows, token_logprobs
from common.sampling import Rollout, completion_mask, encode_prompts, inverse_cdf, row_uniforms, sample, truncate

PROMPTS = ["1>", "12345>", "987>", "4+55="]  # different lengths: left padding is exercised


def test_completion_mask_keeps_tokens_up_to_and_including_the_first_eos():
    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, eos, 7, eos, 8], [5, 6, 7, 8, 9]])
    mask, finished = completion_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert finished.tolist() == [True, True, False]


def test_completion_mask_with_several_eos_ids():
    mask, finished = completion_mask(torch.tensor([[5, 9, 4], [5, 6, 7]]), [2, 9])
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]] and finished.tolist() == [True, False]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_recorded_at_sampling_equal_the_training_forward(tiny_model, tokenizer, temperature):
    prompts = [p for p in PROMPTS for _ in range(4)]
    keys = [(0, 1, i) for i in range(len(prompts))]
    out = rollout(tiny_model, tokenizer, prompts, keys, 12, temperature, [tokenizer.eos_token_id], "cpu")
    with torch.no_grad():
        logps, _ = token_logprobs(tiny_model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                  out.completion_mask, temperature)
    m = out.completion_mask.bool()
    assert (out.prompt_mask == 0).any(), "the test must cover left padding"
    assert torch.allclose(logps[m], out.logprobs[m], atol=1e-5)
    assert torch.all(out.logprobs[~m] == 0)


def test_greedy_sampling_matches_transformers_generate(tiny_model, tokenizer):
    """The same tokens as transformers' greedy search, up to an argmax between two logits that tie within rounding
    (the two compute the logits with other kernels)."""
    ours = rollout(tiny_model, tokenizer, PROMPTS, [(0,)] * 4, 10, 0.0, [tokenizer.eos_token_id], "cpu")
    generated = tiny_model.generate(input_ids=ours.prompt_ids, attention_mask=ours.prompt_mask, max_new_tokens=10,
                                    do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    ids = generated[:, ours.prompt_ids.shape[1]:]
    mask, finished = completion_mask(ids, [tokenizer.eos_token_id])
    theirs = Rollout(ours.prompt_ids, ours.prompt_mask, ids, mask, torch.zeros(ids.shape), finished, [""] * 4)
    assert_same_samples(tiny_model, ours, theirs, None, 10, temperature=0.0)
    assert (ours.completion_mask.sum(-1) > 3).all()  # long enough to compare


def test_a_completion_depends_on_its_key_not_on_its_batch(tiny_model, tokenizer):
    """The same (prompt, key) gives the same completion alone, in a batch, or in another order: each row draws its own
    uniforms. (Up to rounding: a batch pads its prompts to its longest one, which moves the logits by ~1e-6.)"""
    eos, keys = [tokenizer.eos_token_id], [(7, i) for i in range(4)]
    batch = rollout(tiny_model, tokenizer, PROMPTS, keys, 12, 1.0, eos, "cpu")
    alone = [rollout(tiny_model, tokenizer, [p], [k], 12, 1.0, eos, "cpu") for p, k in zip(PROMPTS, keys)]
    assert_same_samples(tiny_model, batch, concat_rollouts(alone, tokenizer.pad_token_id), keys, 12)
    reversed_ = rollout(tiny_model, tokenizer, PROMPTS[::-1], keys[::-1], 12, 1.0, eos, "cpu")
    assert_same_samples(tiny_model, batch, select_rows(reversed_, [3, 2, 1, 0]), keys, 12)
    other_key = rollout(tiny_model, tokenizer, PROMPTS, [(8, i) for i in range(4)], 12, 1.0, eos, "cpu")
    assert other_key.texts != batch.texts


def test_inverse_cdf_sampling_follows_the_softmax(tiny_model, tokenizer):
    """First-token frequencies over 4000 keys match softmax(logits / T) (chi-square, fixed keys)."""
    n, T = 4000, 1.5
    ids, mask = encode_prompts(tokenizer, ["12>"] * n, "cpu")
    with torch.no_grad():
        probs = torch.softmax(tiny_model(input_ids=ids[:1]).logits[0, -1] / T, -1)
    tokens, _ = sample(tiny_model, ids, mask, 1, T, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                       row_uniforms([(3, i) for i in range(n)], 1, "cpu"))
    counts = torch.bincount(tokens[:, 0], minlength=len(probs)).float()
    expected = probs * n
    keep = expected > 5
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum().item()
    dof = keep.sum().item() - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof)  # about 4 standard deviations of a chi-square


def test_row_uniforms_are_reproducible_and_in_range():
    a = row_uniforms([(0, 1, 2), (0, 1, 3)], 5, "cpu")
    assert torch.equal(a, row_uniforms([(0, 1, 2), (0, 1, 3)], 5, "cpu"))
    assert not torch.equal(a[0], a[1]) and ((a >= 0) & (a < 1)).all()


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: some k-subset always passes


def test_prompts_go_through_the_chat_template_when_the_tokenizer_has_one(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        ids, _ = encode_prompts(tokenizer, ["12>"], "cpu")
    finally:
        tokenizer.chat_template = None
    assert tokenizer.decode(ids[0]) == "q: 12> a: "
    plain, _ = encode_prompts(tokenizer, ["12>"], "cpu")
    assert tokenizer.decode(plain[0]) == "12>"


def test_inverse_cdf_never_returns_a_token_of_probability_zero():
    """Adversarial rows: the last ids have probability 0, the float32 cumulative sum ends short of 1 (or above
    it), and u is 1.0 or the largest float32 below 1. A plain search clamped to the last id would return id
    V - 1, of probability 0; the scaled search returns the last token with probability > 0."""
    gen = torch.Generator().manual_seed(0)
    found_short = 0
    for _ in range(200):
        logits = torch.randn(1, 997, generator=gen) * 3
        logits[0, -3:] = -float("inf")  # three impossible tokens at the end of the vocabulary
        logp = torch.log_softmax(logits, -1)
        total = logp.exp().cumsum(-1)[0, -1].item()
        found_short += total < 1.0
        for u in (1.0, 1.0 - 2**-24, total, 0.0):
            token = inverse_cdf(logp, torch.tensor([[u]])).item()
            assert token < 997 - 3 and logp[0, token] > -float("inf"), (u, total, token)
    assert found_short > 10  # the case the guard is for did occur


def test_inverse_cdf_samples_the_distribution():
    logp = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]]))
    u = torch.rand(200_000, 1, generator=torch.Generator().manual_seed(1))
    tokens = inverse_cdf(logp.expand(200_000, 4), u)
    freq = torch.bincount(tokens[:, 0], minlength=4).float() / 200_000
    assert freq.tolist() == pytest.approx([0.1, 0.0, 0.6, 0.3], abs=0.005)


def test_top_p_and_top_k_sample_from_the_truncated_set_and_the_training_forward_scores_it(tiny_model, tokenizer):
    """The random tiny model spreads its probability (high entropy), so truncation matters. Behaviour log-probs are
    those of the renormalised truncated distribution, and token_logprobs under the same truncation gives back the
    same numbers (first-pass ratio 1). Scoring the full distribution instead, as libraries that forget the
    truncation do, gives a ratio equal to the kept mass: well below 1."""
    prompts = [p for p in PROMPTS for _ in range(8)]
    keys = [(3, i) for i in range(len(prompts))]
    for top_k, top_p in ((0, 0.8), (5, 1.0), (5, 0.8)):
        out = rollout(tiny_model, tokenizer, prompts, keys, 10, 1.0, [tokenizer.eos_token_id], "cpu", top_k=top_k, top_p=top_p)
        inputs = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
        m = out.completion_mask.bool()
        with torch.no_grad():
            same, _ = token_logprobs(tiny_model, *inputs, 1.0, top_k=top_k, top_p=top_p)
            full, _ = token_logprobs(tiny_model, *inputs, 1.0)
        assert torch.allclose(same[m], out.logprobs[m], atol=1e-5)
        assert torch.exp(same[m] - out.logprobs[m]).mean().item() == pytest.approx(1.0, abs=1e-5)
        kept_mass = torch.exp(full[m] - out.logprobs[m]).mean().item()
        assert kept_mass < 0.95, (top_k, top_p, kept_mass)  # the known bias: ratio = kept mass
        assert (full[m] <= out.logprobs[m] + 1e-6).all()  # truncation only moves probability onto the kept tokens


def test_truncate_keeps_the_top_k_then_the_smallest_set_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda **kw: torch.isfinite(truncate(logits, **kw))[0].tolist()
    assert kept(top_p=0.6) == [True, True, False, False, False]  # 0.5 < 0.6, 0.5 + 0.2 reaches it
    assert kept(top_p=0.5) == [True, False, False, False, False]
    assert kept(top_k=3) == [True, True, True, False, False]
    assert kept(top_k=3, top_p=0.75) == [True, True, False, False, False]  # top-p of the top-3, renormalised: 0.59, 0.24
    assert kept(top_p=0.5, keep=torch.tensor([3])) == [True, False, False, True, False]  # the scored token stays
    assert torch.equal(truncate(logits), logits)


def test_top_p_keeps_every_token_tied_with_the_last_one_it_keeps():
    """Which of two equal logits a sort puts first is not specified (it differs between devices); both stay."""
    for probs in ([0.4, 0.3, 0.3], [0.3, 0.4, 0.3], [0.3, 0.3, 0.4]):
        assert torch.isfinite(truncate(torch.log(torch.tensor([probs])), top_p=0.5)).all(), probs
    assert torch.isfinite(truncate(torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])), top_p=0.5))[0].tolist() == [True, True, False, False]


def test_a_preallocated_kv_cache_samples_what_the_growing_cache_does(tiny_model, tokenizer, monkeypatch):
    """The cache holds the same keys and values, written in place instead of concatenated: the same tokens and
    log-probs (up to rounding: attention reads a strided view of the buffer instead of a fresh tensor)."""
    import common.sampling

    made, layer = [], common.sampling.PreallocatedLayer
    monkeypatch.setattr(common.sampling, "PreallocatedLayer", lambda *a: (made.append(1), layer(*a))[1])
    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(3)], "cpu")
    keys = [(4, i) for i in range(12)]
    u = row_uniforms(keys, 12, "cpu")
    runs = {}
    for preallocate in (False, True):
        tokens, logps = sample(tiny_model, ids, mask, 12, 1.0, [tokenizer.eos_token_id], tokenizer.pad_token_id, u,
                               preallocate=preallocate)
        cmask, finished = completion_mask(tokens, [tokenizer.eos_token_id])
        runs[preallocate] = Rollout(ids, mask, tokens, cmask, logps * cmask, finished, [""] * 12)
    assert_same_samples(tiny_model, runs[False], runs[True], keys, 12)
    assert runs[True].completion_mask.sum(-1).max() > 6  # several decode steps through the preallocated cache
    assert len(made) == tiny_model.config.num_hidden_layers  # one buffer per layer, for the second run only


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_large_batch_holds_each_prompt_once_and_samples_what_each_rows_copy_samples(tiny_model, tokenizer, temperature,
                                                                                      monkeypatch):
    """With each prompt held once (shared_prompt_rows reached: 0 here), a decode step's attention reads a group's
    prompt once for its rows (prompt_once in every layer) instead of each row's copy: the same tokens and log-probs up to
    rounding, with rows ending at different steps and leaving the batch (groups of unequal sizes)."""
    import common.sampling

    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(3)], "cpu")
    keys = [(7, i) for i in range(12)]
    u = row_uniforms(keys, 12, "cpu")
    eos = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(list("13579"))  # rows end early, at different steps
    runs, reads = {}, []
    once = common.sampling.prompt_once
    monkeypatch.setattr(common.sampling, "prompt_once", lambda *a: (reads.append(len(a[0])), once(*a))[1])
    for rows in (None, 0):
        tokens, logps = sample(tiny_model, ids, mask, 12, temperature, eos, tokenizer.pad_token_id, u,
                               shared_prompt_rows=rows)
        cmask, finished = completion_mask(tokens, eos)
        runs[rows] = Rollout(ids, mask, tokens, cmask, logps * cmask, finished, [""] * 12)
    assert_same_samples(tiny_model, runs[None], runs[0], keys, 12, temperature)
    lengths = runs[0].completion_mask.sum(-1)
    assert lengths.min() < lengths.max() and lengths.max() > 6  # rows ended at different steps; several decode steps
    layers = tiny_model.config.num_hidden_layers
    assert len(reads) % layers == 0 and len(reads) >= 6 * layers  # every layer, every decode step of the second run
    assert min(reads) < 12  # and after rows had left the batch


def test_prompt_once_is_sdpa_on_each_rows_copy_for_every_mask_and_group():
    """The attention of one query position over a prompt held once and each row's own positions, against
    transformers' sdpa_attention_forward on each row's copy: 6 query heads on 2 key/value heads and on 6 (no GQA),
    groups of 3 and 1 rows and a prompt whose rows have all left (dropped from the layer), prompts left-padded;
    boolean, additive (finfo.min), batch-shared, no masks, one with a row's own position masked, and one masking a
    row's whole prompt (its own positions only, no NaN)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from common.sampling import SharedPromptLayer, prompt_once

    g = torch.Generator().manual_seed(0)
    P, L_p, t, D = 3, 5, 4, 8
    rows = torch.tensor([0, 2, 0, 0])  # prompt 0 has 3 rows, prompt 2 one, prompt 1 none
    prompt_mask = torch.ones(P, L_p, dtype=torch.bool)
    prompt_mask[2, :2] = False  # prompt 2 is left-padded by 2
    for H, H_kv in ((6, 2), (6, 6)):
        module = torch.nn.Module()
        module.num_key_value_groups = H // H_kv
        k_p, v_p = torch.randn(P, H_kv, L_p, D, generator=g), torch.randn(P, H_kv, L_p, D, generator=g)
        q, k, v = (torch.randn(4, H, 1, D, generator=g), torch.randn(4, H_kv, t, D, generator=g),
                   torch.randn(4, H_kv, t, D, generator=g))
        padded = torch.cat([prompt_mask[rows], torch.ones(4, t, dtype=torch.bool)], -1)[:, None, None]
        holes, no_prompt = padded.clone(), padded.clone()
        holes[2, ..., L_p + 1] = False
        no_prompt[3, ..., :L_p] = False
        masks = [padded, torch.where(padded, 0.0, torch.finfo(torch.float32).min), padded[1:2], None, holes, no_prompt]
        layer = SharedPromptLayer(k_p, v_p, t, rows)
        assert len(layer.prompt_keys) == 2 and layer.rows.tolist() == [0, 1, 0, 0]  # prompt 1 dropped
        layer.update(k, v)
        assert layer.get_seq_length() == L_p + t
        copies = layer.copies()
        assert torch.equal(copies[0], torch.cat([k_p[rows], k], -2))  # gathered and concatenated: equal by construction
        for i, mask in enumerate(masks):
            own = sdpa_attention_forward(module, q, *copies, mask, scaling=0.3)[0]
            ours = prompt_once(q, layer, layer.keys, layer.values, mask, 0.3)
            assert ours.shape == own.shape == (4, 1, H, D)
            assert torch.allclose(ours, own, atol=1e-5), i


def test_the_shared_prompt_attention_serves_only_its_marked_keys_and_sends_the_rest_to_transformers():
    """A call on a SharedPromptLayer's keys is served (prompt_once, the layer marked served) when it is a decode step;
    a prompt's many query positions get each row's copy, then transformers' function; unmarked keys go there as
    they are; values other than the layer's, or a mask as long as the keys given rather than the layer's positions, are
    refused (the sampler then goes back to each row's copy)."""
    from common.sampling import SharedPromptLayer, shared_prompt_attention

    seen = []
    attention = shared_prompt_attention(lambda module, q, k, v, mask, **kw: (seen.append(k.shape), "transformers'")[1:])
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    layer = SharedPromptLayer(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4), 3, torch.tensor([0, 0, 1]))
    keys, values = layer.update(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))
    out, _ = attention(module, torch.randn(3, 2, 1, 4), keys, values, torch.ones(3, 1, 1, 6, dtype=torch.bool))
    assert out.shape == (3, 1, 2, 4) and layer.served and not seen
    assert attention(module, torch.randn(3, 2, 2, 4), keys, values, None) == ("transformers'",)
    assert seen == [(3, 1, 6, 4)]  # each row's copy of its prompt before its own position
    assert attention(module, torch.randn(3, 2, 1, 4), keys.clone(), values, None) == ("transformers'",)
    assert seen[-1] == (3, 1, 1, 4)  # a tensor made from the keys carries no mark: passed through untouched
    for bad in (dict(mask=torch.ones(3, 1, 1, 1, dtype=torch.bool)), dict(values=values * 2)):  # cut, or derived
        with pytest.raises(ValueError, match="not the cache's"):  # (the sampler goes back to each row's copy)
            attention(module, torch.randn(3, 2, 1, 4), keys, bad.get("values", values), bad.get("mask"))
    layer.served = False  # a 16-bit query: each row's copy, then transformers' function; the layer not marked served
    assert attention(module, torch.randn(3, 2, 1, 4, dtype=torch.bfloat16), keys, values, None) == ("transformers'",)
    assert seen[-1] == (3, 1, 6, 4) and not layer.served


def test_the_cache_holding_each_prompt_once_is_freed_when_the_rollout_ends(tiny_model, tokenizer, monkeypatch):
    """The mark on a layer's keys refers to the layer weakly: with the garbage collector off, the layers (and their
    buffers, most of an evaluation's memory) go as soon as sample() returns."""
    import gc
    import weakref

    import common.sampling

    made, layer = [], common.sampling.SharedPromptLayer
    monkeypatch.setattr(common.sampling, "SharedPromptLayer", lambda *a: (lambda x: (made.append(weakref.ref(x)), x)[1])(layer(*a)))
    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(2)], "cpu")
    gc.disable()
    try:
        sample(tiny_model, ids, mask, 4, 0.0, [], tokenizer.pad_token_id, shared_prompt_rows=0)
        assert len(made) == tiny_model.config.num_hidden_layers and all(ref() is None for ref in made)
    finally:
        gc.enable()


@pytest.mark.parametrize("preallocate, temperature", [(True, 1.0), (False, 1.0), (True, 0.0)])
def test_ended_rows_leave_the_decoding_batch_and_the_others_draw_what_they_would_have(tokenizer, preallocate, temperature):
    """The embedded model on prompts of 3 to 7 digits: completions end at different steps. With leave_batch the rows
    that ended are dropped from the batch (and from the KV cache) once they are a quarter of it; every row keeps its
    uniforms, so the tokens and log-probs are those of the whole batch up to rounding (other matrix shapes)."""
    from common.models import load_model, resolve_model

    model = load_model(resolve_model("embedded", "reverse")).eval()
    prompts = [f"{n}>" for n in (123, 4567, 89012, 345678, 9012345, 67, 8901, 23456)]
    ids, mask = encode_prompts(tokenizer, [p for p in prompts for _ in range(2)], "cpu")
    keys = [(5, i) for i in range(16)]
    u = row_uniforms(keys, 12, "cpu")
    runs, rows = {}, {}
    for leave in (None, 0.25):
        batch_sizes = []
        hook = model.register_forward_pre_hook(lambda m, a, k: batch_sizes.append(len(k["input_ids"])), with_kwargs=True)
        tokens, logps = sample(model, ids, mask, 12, temperature, [tokenizer.eos_token_id], tokenizer.pad_token_id, u,
                               preallocate=preallocate, leave_batch=leave)
        hook.remove()
        cmask, finished = completion_mask(tokens, [tokenizer.eos_token_id])
        runs[leave], rows[leave] = Rollout(ids, mask, tokens, cmask, logps * cmask, finished, [""] * 16), batch_sizes
    assert_same_samples(model, runs[None], runs[0.25], keys, 12, temperature)  # log-probs to 1e-5 where tokens agree
    lengths = runs[None].completion_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows ended at different steps
    assert all(n == 16 for n in rows[None][1:]) and min(rows[0.25][1:]) < 16  # the decoding batch shrank
    assert sum(rows[0.25]) < sum(rows[None])


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_sampler_applies_the_output_layer_a_few_rows_at_a_time_and_draws_what_the_whole_logits_draw(
        tiny_model, tokenizer, monkeypatch, temperature):
    """Where the forward ends in the output layer, a decode step asks the model for hidden states only and draw()
    applies the layer DRAW_BYTES of logits at a time (3 rows here): the same tokens as the model's own (B, V) logits up
    to rounding, and the layer never sees more than 3 rows after the prompts' step."""
    import common.sampling

    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(3)], "cpu")
    keys = [(6, i) for i in range(12)]
    u = row_uniforms(keys, 12, "cpu")
    V = tiny_model.config.vocab_size
    assert common.sampling.output_layer(tiny_model) is not None  # (its one probe forward, before the hook counts)
    runs, seen = {}, {}
    for apart in (False, True):
        if not apart:
            monkeypatch.setattr(common.sampling, "output_layer", lambda model: None)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(common.sampling, "DRAW_BYTES", 3 * 4 * V)
        rows = []
        hook = tiny_model.lm_head.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[:-1].numel()))
        tokens, logps = sample(tiny_model, ids, mask, 12, temperature, [tokenizer.eos_token_id], tokenizer.pad_token_id, u)
        hook.remove()
        cmask, finished = completion_mask(tokens, [tokenizer.eos_token_id])
        runs[apart], seen[apart] = Rollout(ids, mask, tokens, cmask, logps * cmask, finished, [""] * 12), rows
    assert_same_samples(tiny_model, runs[False], runs[True], keys, 12, temperature)
    assert runs[True].completion_mask.sum(-1).max() > 6
    assert seen[True][0] == seen[False][0] == 4  # the prompts' step: one row per distinct prompt
    assert max(seen[True][1:]) <= 3 and max(seen[False][1:]) == 12  # (the model's own call on 0 rows: no logits)


def test_an_evaluation_cache_samples_the_base_model_once_and_misses_on_any_change(tmp_path, monkeypatch):
    """evaluate(cache_dir=...) keeps each set's completions under the hash of what they depend on: the same weights,
    prompts, seed and flags load them (no sampling, the same metrics); another seed, top-k, set of prompts, autocast
    dtype, matrix-product kernel or changed weights sample again. Metrics are scored afresh from the completions each time; a multi-turn
    task (its environments' rewards ride in the rollout) is never cached."""
    import common.rollout
    from common.models import autocast_forward, eos_token_ids, load_model, load_tokenizer, resolve_model
    from common.rollout import evaluate
    from common.tasks import load_task

    path = resolve_model("embedded", "reverse")
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    calls = []
    real = common.rollout.rollout
    monkeypatch.setattr(common.rollout, "rollout", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def run(seed=0, cache=tmp_path / "cache", top_k=0, task=load_task("reverse", num_test=6), policy=model):
        calls.clear()
        out = evaluate(policy, tokenizer, task, 2, 2, 8, 1.0, eos_token_ids(model, tokenizer), "cpu", seed, top_k=top_k,
                       cache_dir=cache)
        return {k: v for k, v in out.items() if not k.startswith("time/")}, len(calls)

    plain, sampled = run(cache=None)
    assert sampled == 1  # one pass: the greedy rows ride with the samples
    first, sampled = run()
    assert sampled == 1 and first == plain and len(list((tmp_path / "cache").iterdir())) == 1
    again, sampled = run()
    assert sampled == 0 and again == plain  # loaded, scored again: the same numbers
    assert run(seed=1)[1] == 1  # other draws
    assert run(top_k=5)[1] == 2  # another sampling flag (truncated samples: the greedy pass apart, untruncated)
    assert run(task=load_task("reverse", num_test=5))[1] == 1  # other prompts
    chain = load_task("chain-2", num_test=3)
    assert run(task=chain)[1] == run(task=chain)[1] > 0  # multi-turn: sampled every time
    assert run(policy=autocast_forward(load_model(path), "bfloat16"))[1] == 1  # float32 weights, bf16 forward
    if torch.backends.mkldnn.is_available():  # the same weights, products by another kernel (equal up to rounding)
        from common.models import onednn_linears

        assert run(policy=(lambda m: (onednn_linears(m, on=True), m)[1])(load_model(path).eval()))[1] == 1
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1e-3
    assert run()[1] == 1  # other weights


def test_the_evaluation_cache_key_is_the_sampler_code_this_process_imported(tiny_model, tokenizer, monkeypatch):
    """A run that outlives an edit of common/ must not file its completions under the edited code's key."""
    before = model_digest(tiny_model, tokenizer)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "edited since")
    assert model_digest(tiny_model, tokenizer) == before


def test_greedy_rows_ride_in_the_sampled_batch_and_draw_what_two_passes_draw(tiny_model, tokenizer):
    """rollout with a temperature per row (the evaluation's samples at 1.0 and its greedy rows at 0, one batch): the sampled
    rows' tokens are those of the sampled pass alone and the greedy rows' those of the greedy pass alone, up to
    rounding; a greedy row's log-probs are at temperature 1, as the greedy pass records them."""
    prompts, eos = ["123>", "4567>", "89>"], [tokenizer.eos_token_id]
    keys = [(0, 7, i, j) for i in range(3) for j in range(2)]
    sampled_prompts = [p for p in prompts for _ in range(2)]
    both = rollout(tiny_model, tokenizer, sampled_prompts + prompts, keys + [(0,)] * 3, 10, [1.0] * 6 + [0.0] * 3, eos, "cpu")
    sampled = rollout(tiny_model, tokenizer, sampled_prompts, keys, 10, 1.0, eos, "cpu")
    greedy = rollout(tiny_model, tokenizer, prompts, [(0,)] * 3, 10, 0.0, eos, "cpu")
    assert_same_samples(tiny_model, select_rows(both, list(range(6))), sampled, keys, 10)
    assert_same_samples(tiny_model, select_rows(both, [6, 7, 8]), greedy, None, 10, temperature=0.0)
    m = greedy.completion_mask.bool()
    width = greedy.logprobs.shape[1]
    assert torch.allclose(select_rows(both, [6, 7, 8]).logprobs[:, :width][m], greedy.logprobs[m], atol=1e-5)
