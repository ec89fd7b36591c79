"""Rollouts and the training forward: prompts in, Rollouts out (single-turn through common/sampling.py, multi-turn
through common/multiturn.py); micro-batches of a Rollout; the log-probs of its tokens under any model (the training
forward: a group's prompt once, the output layer a chunk at a time); pass@k and the held-out evaluation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cli import ConfigError
from common.multiturn import multi_turn_rollout
from common.sampling import (Rollout, _accepts, base_model, completion_mask, distinct_prompts, encode_prompts,
                             full_parameters, output_layer, row_uniforms, sample, truncate)


def rollout(model, tokenizer, prompts: list[str], keys: list[tuple[int, ...]], max_new_tokens: int,
            temperature: float | list[float], eos_ids: list[int], device, envs: list | None = None,
            batch_size: int | None = None, top_k: int = 0, top_p: float = 1.0, engine=None) -> Rollout:
    """One completion per prompt (repeat a prompt G times for a group), row b seeded by keys[b]; temperature one for all
    rows, or a list of each row's (single-turn, no engine: greedy rows at 0 beside sampled ones). With
    envs (a multi-turn task, task.envs(answers)): one trajectory per env, common/multiturn.py. With
    batch_size, rows are sampled batch_size at a time (less memory); each row draws its own noise, so the
    tokens are those of one pass, up to rounding (common/sampling.py's docstring). With an engine (--engine vllm,
    common/engine.py), sampled by it instead: it holds model's weights."""
    if engine is not None:
        return engine.rollout(tokenizer, prompts, keys, max_new_tokens, temperature, eos_ids, device, top_k, top_p)
    if batch_size is not None and len(prompts) > batch_size:
        return concat_rollouts([rollout(model, tokenizer, prompts[i : i + batch_size], keys[i : i + batch_size],
                                        max_new_tokens, temperature[i : i + batch_size] if isinstance(temperature, list)
                                        else temperature, eos_ids, device,
                                        envs[i : i + batch_size] if envs is not None else None, top_k=top_k, top_p=top_p)
                                for i in range(0, len(prompts), batch_size)], tokenizer.pad_token_id)
    if envs is not None:
        with full_parameters(model):
            return multi_turn_rollout(model, tokenizer, envs, prompts, keys, max_new_tokens, temperature, eos_ids, device,
                                      top_k, top_p)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    if isinstance(temperature, list):  # one value for every row (a chunk of greedy rows alone, say): a float
        temperature = temperature[0] if len(set(temperature)) == 1 else torch.tensor(temperature, device=device)
    stochastic = bool((temperature > 0).any()) if torch.is_tensor(temperature) else temperature > 0
    uniforms = row_uniforms(keys, max_new_tokens, device) if stochastic else None
    was_training = model.training
    model.eval()
    with full_parameters(model):
        ids, logprobs = sample(model, prompt_ids, prompt_mask, max_new_tokens, temperature, eos_ids,
                               tokenizer.pad_token_id, uniforms, top_k, top_p)
    model.train(was_training)
    mask, finished = completion_mask(ids, eos_ids)
    texts = tokenizer.batch_decode(ids * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, ids, mask, logprobs * mask, finished, texts)


def _map_rollout(batch: Rollout, fn) -> Rollout:
    """A rollout whose every field is fn(field value)."""
    return Rollout(**{f.name: fn(getattr(batch, f.name)) for f in dataclasses.fields(Rollout)})


def select_rows(batch: Rollout, rows: list[int]) -> Rollout:
    """The given rows of a rollout, in that order."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.completion_ids.device)

    def pick(value):
        if value is None or isinstance(value, int):
            return value
        return [value[i] for i in rows] if isinstance(value, list) else value[index]

    return _map_rollout(batch, pick)


@dataclass
class MicroBatch:
    """Some rows of a rollout, trimmed to their own longest prompt and completion (no column of padding alone)."""
    rows: torch.Tensor  # their indices in the rollout
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    attention_mask: torch.Tensor  # model and environment tokens (what the training forward attends to)
    completion_mask: torch.Tensor  # the model's tokens (what the loss counts)
    logprobs: torch.Tensor  # the behaviour log-probs recorded at sampling
    turn_ids: torch.Tensor | None

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """What token_logprobs takes: attention on model and environment tokens (the loss masks the latter)."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.attention_mask


def trimmed(batch: Rollout, rows: torch.Tensor) -> MicroBatch:
    """The given rows, their prompts cut to the longest one among them (left padding) and their completions to the
    longest one (right padding): the columns dropped are padding in every row, so the forward computes the same."""
    rows = rows.to(batch.completion_ids.device)
    prompt_mask, attention_mask = batch.prompt_mask[rows], batch.attention_mask[rows]
    P = max(int(prompt_mask.sum(-1).max()), 1)
    T = max(int(attention_mask.sum(-1).max()), 1)
    return MicroBatch(rows, batch.prompt_ids[rows][:, -P:], prompt_mask[:, -P:], batch.completion_ids[rows][:, :T],
                      attention_mask[:, :T], batch.completion_mask[rows][:, :T], batch.logprobs[rows][:, :T],
                      batch.turn_ids[rows][:, :T] if batch.turn_ids is not None else None)


def micro_batches(batch: Rollout, group_size: int, count: int = 1, max_tokens: int | None = None,
                  shared_prompts: bool = True) -> list[MicroBatch]:
    """The rollout's rows in micro-batches of whole groups (a group's rows share their prompt's forward), each trimmed
    to its own longest prompt and completion. Groups are ordered by their longest completion, so that a micro-batch
    holds groups of like lengths. `count` micro-batches of about equal numbers of groups; or, with max_tokens, as many
    as keep each one's tokens (its prompts once a group, or once a row without shared_prompts, and its rows'
    completions, padding included) within max_tokens, at least `count` (a group alone may exceed it). Gradient
    accumulation over them gives the one-batch update as long as the loss is normalised by the whole batch's counts
    (common/losses.py: aggregate)."""
    groups = batch.completion_ids.shape[0] // group_size
    longest = batch.attention_mask.sum(-1).view(groups, group_size).max(-1).values.tolist()
    prompt = batch.prompt_mask.sum(-1).view(groups, group_size).max(-1).values.tolist()
    order = sorted(range(groups), key=lambda g: -longest[g])

    def tokens(pack: list[int]) -> int:  # what its forwards compute: each prompt once (or per row), every row's completion
        prompts = len(pack) if shared_prompts else len(pack) * group_size
        return prompts * max(prompt[g] for g in pack) + len(pack) * group_size * max(longest[g] for g in pack)

    if max_tokens is None:
        packs = [chunk.tolist() for chunk in torch.tensor(order).tensor_split(min(count, groups))]
    else:
        packs = [[]]
        for g in order:
            if packs[-1] and tokens(packs[-1] + [g]) > max_tokens:
                packs.append([])
            packs[-1].append(g)
        while len(packs) < min(count, groups):  # at least `count`: halve the largest
            i = max(range(len(packs)), key=lambda i: len(packs[i]))
            packs[i : i + 1] = [packs[i][: len(packs[i]) // 2], packs[i][len(packs[i]) // 2 :]]
    return [trimmed(batch, torch.tensor([g * group_size + r for g in sorted(pack) for r in range(group_size)]))
            for pack in packs]


def rollout_to(batch: Rollout, device) -> Rollout:
    """The rollout's tensors on `device` (a generator on its own device hands its batch to the learner; the
    copy runs in the generator's thread, so the learner never waits for it; same device: no copy)."""
    return _map_rollout(batch, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts of consecutive rows as one: prompts left-padded and completions right-padded to the longest."""
    def pad(tensors, value, left=False):
        width = max(t.shape[1] for t in tensors)
        return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
                          for t in tensors])

    def lists(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else [x for v in values for x in v]

    return Rollout(
        pad([p.prompt_ids for p in parts], pad_id, left=True), pad([p.prompt_mask for p in parts], 0, left=True),
        pad([p.completion_ids for p in parts], pad_id), pad([p.completion_mask for p in parts], 0),
        pad([p.logprobs for p in parts], 0.0), torch.cat([p.finished for p in parts]), lists("texts"),
        attention_mask=pad([p.attention_mask for p in parts], 0), rewards=lists("rewards"), successes=lists("successes"),
        done=lists("done"), turn_rewards=lists("turn_rewards"), turn_texts=lists("turn_texts"),
        turn_ids=pad([p.turn_ids for p in parts], -1) if parts[0].turn_ids is not None else None,
        max_turns=max(p.max_turns for p in parts),
    )


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_hidden: bool = False,
                      share_prompts: bool = True, logits: bool = True):
    """Logits at the positions that predict completion tokens y_1..y_T (B, T, V), with the same positions and mask
    as at sampling; and the last layer's hidden states there (B, T, H) if asked. With logits=False the model computes
    no logits (None in their place): the caller applies the output layer itself (token_logprobs).

    A group's G rows share one prompt: it runs once, and its keys and values serve the G completions (the cache is
    index-selected, so autograd sums the G rows' gradients into the prompt's), as verl's "prefix grouper" does. The
    arithmetic of the prompt tokens is then done once a group instead of G times: exact up to rounding. (The prompt's
    last token runs with each row, so that one forward gives all T logits, with no copy of them.) It needs a
    model that returns a KV cache in training mode, which transformers refuses under gradient checkpointing: there
    (and with share_prompts=False, or no shared prompt) every row runs its prompt, in one forward."""
    shared = None
    if share_prompts and prompt_ids.shape[1] > 1 and runs_prompts_once(model):
        shared = distinct_prompts(prompt_ids, prompt_mask)
    if shared is None:
        return _whole_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_hidden, logits)
    first, rows = shared
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    # 1. each distinct prompt once, but for its last token: the keys and values that the G completions attend to
    position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    none = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=prompt_ids.device)}  # no logits: nothing predicted
    head = getattr(model, "module", model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    out = head(input_ids=prompt_ids[first, : P - 1], attention_mask=prompt_mask[first, : P - 1],
               position_ids=position[first, : P - 1], use_cache=True, **(none if _accepts(model, "logits_to_keep") else {}))
    cache = _cache_of(out)  # (DDP: one forward through its wrapper per backward, the next one)
    if not hasattr(cache, "reorder_cache"):  # not a transformers cache: no sharing
        return _whole_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_hidden, logits)
    cache.reorder_cache(rows)  # row b takes its prompt's keys and values; backward sums the G rows into them
    # 2. per row, the prompt's last token and the completion but its last token: the T positions predicting y_1..y_T
    input_ids = torch.cat([prompt_ids[:, P - 1 :], completion_ids[:, : T - 1]], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask[:, : T - 1]], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, P - 1 :]
    keep = {"logits_to_keep": torch.arange(T if logits else 0, device=prompt_ids.device)} if _accepts(model, "logits_to_keep") else {}
    cache_kw = "cache" if _accepts(model, "cache") else "past_key_values"
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                output_hidden_states=with_hidden, **{cache_kw: cache}, **keep)
    return (out.logits if logits else None), (out.hidden_states[-1] if with_hidden else None)


def runs_prompts_once(model) -> bool:
    """Whether the training forward runs a group's prompt once (completion_logits): a forward returns a KV cache in
    the mode the model is in (transformers drops the cache of a model that checkpoints its activations in training
    mode). micro_batches' token budget counts the prompts accordingly."""
    inner = base_model(model)
    checkpointing = checkpoints_activations(inner) and inner.training
    return not checkpointing and (_accepts(model, "past_key_values") or _accepts(model, "cache"))


def checkpoints_activations(model) -> bool:
    """Whether activation checkpointing is on: transformers >= 5.25 names it is_activation_checkpointing (the old name
    warns that it goes in v6), the releases before is_gradient_checkpointing."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _whole_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_hidden: bool, logits: bool = True):
    """Every row's prompt and completion in one forward, logits at the T predicting positions only."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    L, T = input_ids.shape[1], completion_ids.shape[1]
    # Logits at the T positions that predict y_1..y_T only, none over the prompt. Asked for by an index tensor, not by
    # a count: the model then gathers those hidden states into a new contiguous tensor, and the output layer is one
    # matrix product whether or not its weight requires a gradient. (A count slices a non-contiguous view, for which
    # torch.matmul picks mm when the weight requires a gradient and bmm when it does not: the policy and a frozen
    # reference would then round differently, and their KL at equal weights would not be exactly 0.)
    predicting = torch.arange(L - T - 1, L - 1, device=input_ids.device)
    keep = {"logits_to_keep": predicting if logits else predicting[:0]} if _accepts(model, "logits_to_keep") else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                output_hidden_states=with_hidden, **keep)
    hidden = out.hidden_states[-1][:, -T - 1 : -1] if with_hidden else None
    return ((out.logits if keep else out.logits[:, -T - 1 : -1]) if logits else None), hidden


def logprobs_from_logits(logits, tokens, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
                         top_k: int = 0, top_p: float = 1.0):
    """log softmax(logits / temperature) at the given tokens, truncated to top_k / top_p as the sampler was (the
    scored token kept); and the entropy of that distribution if asked (without a gradient if entropy_grad is
    False: a diagnostic then costs no autograd memory). The vocabulary-wide passes run on a (rows x V) view, which
    torch's CPU kernels run several times faster than on (B, T, V)."""
    B, T, V = logits.shape
    scaled = logits.float().reshape(B * T, V)
    if temperature not in (0, 1):
        scaled = scaled / temperature
    truncated = top_k > 0 or top_p < 1.0
    logp_all = torch.log_softmax(truncate(scaled, top_k, top_p, keep=tokens.reshape(-1)) if truncated else scaled, dim=-1)
    logps = logp_all.gather(-1, tokens.reshape(-1, 1)).view(B, T)
    entropy = None
    if with_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            p = logp_all.exp()  # 0 log 0 = 0 outside a truncated set (masked first: a NaN there would reach the gradient)
            entropy = -(p * (logp_all.masked_fill(p == 0, 0.0) if truncated else logp_all)).sum(-1).view(B, T)
    return logps, entropy


CHUNK_BYTES = 2**25  # logits of at most 32 MB at a time: small enough for the allocator to reuse, never a page fault


def chunked_logprobs(head, autocast_dtype, hidden, tokens, temperature: float, with_entropy: bool, top_k: int, top_p: float):
    """logprobs_from_logits(head(hidden), tokens, ...) a chunk of positions at a time: the (B, T, V) logits are never
    held. Under autograd each chunk is checkpointed (only its hidden states are kept; its logits are computed again
    in the backward pass, a third more arithmetic in the output layer), so the vocabulary-wide tensors of one chunk
    exist at a time, in the forward and in the backward, as TRL's and Liger's chunked losses do."""
    from torch.utils.checkpoint import checkpoint

    B, T, H = hidden.shape
    flat, flat_tokens = hidden.reshape(B * T, H), tokens.reshape(-1)
    rows = max(1, CHUNK_BYTES // (4 * head.out_features))
    context = (lambda: torch.autocast(hidden.device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext

    def part(h, y):
        with context():
            logits = head(h)
        return logprobs_from_logits(logits[None], y[None], temperature, with_entropy, False, top_k, top_p)

    logps, entropy = [], []
    for i in range(0, B * T, rows):
        h, y = flat[i : i + rows], flat_tokens[i : i + rows]
        lp, ent = checkpoint(part, h, y, use_reentrant=False) if torch.is_grad_enabled() and h.requires_grad else part(h, y)
        logps.append(lp[0])
        entropy.append(ent[0] if ent is not None else None)
    return torch.cat(logps).view(B, T), (torch.cat(entropy).view(B, T) if with_entropy else None)


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                   with_entropy: bool = False, top_k: int = 0, top_p: float = 1.0,
                   share_prompts: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) of each completion token under softmax(logits / temperature) (truncated to top_k /
    top_p when the sampler was), with the same positions and mask as at sampling; and the entropy of that
    distribution if asked (a diagnostic, without a gradient). The output layer runs a chunk of positions at a time
    (chunked_logprobs) where it can be applied apart from the model's forward (output_layer)."""
    head = output_layer(model)
    inputs = (model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    if head is None:
        logits, _ = completion_logits(*inputs, share_prompts=share_prompts)
        return logprobs_from_logits(logits, completion_ids, temperature, with_entropy, entropy_grad=False, top_k=top_k,
                                    top_p=top_p)
    _, hidden = completion_logits(*inputs, with_hidden=True, share_prompts=share_prompts, logits=False)
    return chunked_logprobs(*head, hidden, completion_ids, temperature, with_entropy, top_k, top_p)


FORWARD_TOLERANCE = 1e-3  # float32: the paths agree to ~1e-6 on every family that works; a wrong one is off by > 1e-2
CHECKED_LENGTH = 17  # the longest sequence of forward_mismatch's small batch (a 9-token prompt and 8 tokens after it)


def check_lengths(reach: int | None) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]] | None]:
    """forward_mismatch's batches: (prompt length, [its completions' lengths]) for the training forward, and for the
    sampler (None: the same batch's prompts), which draws 8 tokens after its prompts. Up to CHECKED_LENGTH tokens,
    one batch of two prompts of 5 and 9 tokens, two completions each. For a run that reaches further (reach: its longest
    prompt plus its completion budget), a 5-token prompt scored to the reach (the training forward past every position
    a run scores, from a cached short prompt: where a model's positions change its arithmetic, a cached prompt and the
    model's own uncached forward part there), and a prompt of reach - 8 tokens that the sampler continues by 8 (its
    prefill and cached decoding at the reach): about six forwards of the reach, not reach decoding steps."""
    if reach is None or reach <= CHECKED_LENGTH:
        return [(5, [3, 8]), (9, [6, 4])], None
    return [(5, [reach - 5, 3])], [(reach - 8, [1, 1])]


def random_batch(lengths: list[tuple[int, list[int]]], g: torch.Generator, low: int, high: int, device) -> list:
    """Prompts (left-padded) and completions (right-padded) of random ids in [low, high): [ids, mask, ids, mask]."""
    rows, P, T = sum(len(ts) for _, ts in lengths), max(p for p, _ in lengths), max(t for _, ts in lengths for t in ts)
    prompt_ids, completion_ids = torch.zeros(rows, P, dtype=torch.long), torch.zeros(rows, T, dtype=torch.long)
    prompt_mask, mask = torch.zeros_like(prompt_ids), torch.zeros_like(completion_ids)
    b = 0
    for p, ts in lengths:
        prompt = torch.randint(low, high, (p,), generator=g)
        for t in ts:
            prompt_ids[b, P - p :], prompt_mask[b, P - p :] = prompt, 1
            completion_ids[b, :t], mask[b, :t] = torch.randint(low, high, (t,), generator=g), 1
            b += 1
    return [x.to(device) for x in (prompt_ids, prompt_mask, completion_ids, mask)]


@torch.no_grad()
def forward_mismatch(model, seed: int = 0, reach: int | None = None) -> dict[str, float]:
    """How far what postrl computes in place of the model's own forward lies from it, on small random batches (prompts
    left-padded, completions right-padded, a prompt's completions sharing it: check_lengths, up to the run's reach): the
    largest |log-prob difference| of (train) the training forward, token_logprobs in training mode (the prompts
    shared through the KV cache, the output layer applied apart where head_is_last), and of (sampler) the sampler's
    behaviour log-probs (prompts shared, the preallocated cache with each row's copy of its prompt and with each prompt
    held once, ended rows leaving the batch), each against
    log_softmax of the model's own forward of each row alone, unpadded and uncached. In float32, bf16 autocast set
    aside and bf16 or fp16 weights (--pure-dtype) cast to float32 for the check and back (exact both ways): what is
    checked is the arithmetic postrl replaces, not the rounding of a 16-bit forward, which differs between the model's
    own forward of a row alone and of the same row padded in a batch by more than a wrong path might."""
    inner = base_model(model)
    V = inner.get_input_embeddings().weight.shape[0] if hasattr(inner, "get_input_embeddings") else inner.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    device = next(inner.parameters()).device
    low, high = V // 4, max(V // 4 + 1, 3 * V // 4)  # ids from the middle of the vocabulary: no special token
    train_lengths, sampler_lengths = check_lengths(reach)
    batch = random_batch(train_lengths, g, low, high, device)
    prompts = batch[:2] if sampler_lengths is None else random_batch(sampler_lengths, g, low, high, device)[:2]
    steps = 8

    def own(prompt_ids, prompt_mask, completions, completion_mask):  # row by row, no padding, no cache
        out = torch.zeros(completions.shape, device=device)
        for b in range(len(completions)):
            x, y = prompt_ids[b][prompt_mask[b].bool()], completions[b][completion_mask[b].bool()]
            logits = model(input_ids=torch.cat([x, y])[None], use_cache=False).logits[0, len(x) - 1 : -1].float()
            out[b, : len(y)] = torch.log_softmax(logits, -1).gather(-1, y[:, None])[:, 0]
        return out

    was_training = model.training
    try:
        with float32_forward(model), no_dropout_modules(model):  # LoRA's --lora-dropout: the user's noise, not a mismatch
            train, _ = token_logprobs(model.train(), *batch)  # in training mode, as it trains
            model.eval()  # the sampler and the model's own forward: in eval mode, as it samples
            uniforms = torch.rand(len(prompts[0]), steps, generator=g).to(device)
            # a sixth of the ids end a row (rows leave the batch); at the reach none does: every row decodes to the reach
            eos = list(range(low, low + max(1, (high - low) // 6))) if sampler_lengths is None else []
            reference, sampler = own(*batch), []
            for once in (None, 0):  # each row's copy of its prompt (a small batch), each prompt held once (a large one)
                sampled, behaviour = sample(model, *prompts, steps, 1.0, eos, 0, uniforms, shared_prompt_rows=once)
                ended = completion_mask(sampled, eos)[0]
                sampler.append((behaviour.float() * ended - own(*prompts, sampled, ended)).abs().max().item())
    finally:
        model.train(was_training)
    m = batch[3].bool()
    return {"train": (train[m].float() - reference[m]).abs().max().item(),
            "sampler": max(sampler) if all(d == d for d in sampler) else float("nan")}  # NaN stays NaN


@contextmanager
def no_dropout_modules(model):
    """Every torch.nn.Dropout of model at p = 0 for a while (disable_dropout has set the model's own to 0 already)."""
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    for m, _ in dropouts:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in dropouts:
            m.p = p


@contextmanager
def float32_forward(model):
    """The model's forward in float32 for a while: the bf16 autocast common/models.py patches onto it set aside, output
    layer included (its autocast_dtype, which chunked_logprobs reads), and 16-bit floating weights and buffers (pure
    bf16 or fp16, --pure-dtype) cast to float32 in place, then back (bf16 -> float32 -> bf16 is exact: every bf16
    value is a float32 value). The weights take twice their memory meanwhile."""
    inner = base_model(model)
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.dtype in (torch.bfloat16, torch.float16)]
    dtypes = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.float()
    aside = {k: inner.__dict__.pop(k) for k in ("forward", "autocast_dtype") if k in inner.__dict__}
    try:
        yield
    finally:
        inner.__dict__.update(aside)
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


def length_switch(model) -> tuple[str, int] | None:
    """(rope type, n) where the model's rotary frequencies change once a sequence is longer than n tokens, else None.
    transformers' dynamic_rope_update recomputes them from the longest position of each forward: dynamic NTK scaling
    past max_position_embeddings (from each length anew), Phi-3's longrope from its short to its long factors past
    original_max_position_embeddings. Then a prompt's keys, cached when the sequence was shorter, are rotated with other
    frequencies than the model's own forward of the whole sequence uses: the training forward (a group's prompt run once)
    and the sampler (a KV cache) score such a sequence otherwise than the model does. Linear, yarn and llama3 scaling
    are fixed frequencies: no switch."""
    limits = []
    for module in base_model(model).modules():
        types = getattr(module, "rope_type", None)
        if not isinstance(types, (str, dict)) or not hasattr(module, "original_max_seq_len"):
            continue
        for layer_type, rope_type in (types.items() if isinstance(types, dict) else [(None, types)]):
            if "dynamic" in rope_type:
                limits.append((module.original_max_seq_len, rope_type))
            elif rope_type == "longrope":
                params = module.config.rope_parameters
                params = params[layer_type] if layer_type is not None else params
                limits.append((params.get("original_max_position_embeddings", module.original_max_seq_len), rope_type))
    return (min(limits)[1], min(limits)[0]) if limits else None


def run_reach(task, tokenizer, max_new_tokens: int) -> int:
    """The longest sequence a run scores or samples: its longest prompt as the sampler encodes it (chat template
    included; training, held-out and extra sets), plus its completion budget: max_new_tokens, and for a multi-turn task
    the trajectory's env.max_tokens after the prompt besides (its last turn starts below that budget and the sampler
    decodes up to max_new_tokens more, the turn cut to the budget only afterwards; a batch's longest row sets the
    positions every row is scored at)."""
    prompts = [p for data in (task.train, task.test, *task.extra_tests.values()) for p in data["prompt"]]
    unique = list({p if isinstance(p, str) else repr(p): p for p in prompts}.values())
    longest = max(int(encode_prompts(tokenizer, [p], "cpu")[1].sum()) for p in unique) if unique else 0
    budget = max_new_tokens
    if task.env is not None:  # a last turn starts below env.max_tokens and decodes up to max_new_tokens before its cut
        budget += task.env(task.train[0]["answer"]).max_tokens
    return longest + budget


def check_forward(model, name: str, reach: int | None = None) -> None:
    """Refuse, in one line, a model whose log-probs postrl would compute wrongly (forward_mismatch above the
    tolerance), or that postrl's forward cannot run at all (an encoder-decoder, say): before any training step. With
    reach (run_reach: the longest sequence the run can reach), checked up to that length too, and a model whose rotary
    frequencies switch before it (length_switch) refused with the reason."""
    inner = base_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"--model {name}: {type(inner).__name__} is an encoder-decoder model; postrl trains "
                          f"decoder-only causal language models")
    switch = length_switch(model)
    if switch is not None and reach is not None and reach > switch[1]:
        raise ConfigError(f"--model {name}: its rotary frequencies change past {switch[1]} tokens (rope_type "
                          f"{switch[0]}), so a cached prompt is scored otherwise than its own forward scores the whole "
                          f"sequence, and this run reaches {reach} tokens (longest prompt + completion budget): lower "
                          f"--max-new-tokens or shorten the prompts to stay within {switch[1]}")
    try:
        mismatch = forward_mismatch(model)
        if reach is not None and reach > CHECKED_LENGTH:
            at_reach = forward_mismatch(model, reach=reach)
            mismatch = {k: max(v, w) if v == v and w == w else float("nan") for (k, v), w in  # NaN stays NaN
                        zip(mismatch.items(), at_reach.values())}
    except (MemoryError, torch.OutOfMemoryError):  # the machine's limit, not the model's family
        raise
    except Exception as e:  # noqa: BLE001 -- any other failure here is a model family postrl cannot serve
        raise ConfigError(f"--model {name}: postrl cannot run this model ({type(model).__name__}): "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not all(value <= FORWARD_TOLERANCE for value in mismatch.values()):  # (NaN is not <= anything: refused)
        raise ConfigError(f"--model {name}: postrl's log-probs for this model ({type(model).__name__}) differ from its own "
                          f"forward's by up to {mismatch['train']:.2g} (training forward) and {mismatch['sampler']:.2g} "
                          f"(sampler){f' at sequences of up to {reach} tokens' if reach and reach > CHECKED_LENGTH else ''}"
                          f": not supported")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


EVAL_KEY = 2**31 - 1  # the eval draws use keys (seed, EVAL_KEY, prompt, sample): the same at every eval


@torch.no_grad()
def evaluate(model, tokenizer, task, n: int, k: int, max_new_tokens: int, temperature: float, eos_ids: list[int],
             device, seed: int, rank: int = 0, world: int = 1, batch_size: int | None = None, top_k: int = 0,
             top_p: float = 1.0, cache_dir: str | None = None) -> dict[str, float]:
    """pass@1 and pass@k from n samples per held-out prompt at the sampling temperature (unbiased
    estimator), greedy accuracy, and mean sampled reward; on task.test (eval/...) and on each of task.extra_tests
    (eval/<name>/...). Prompts are sharded over processes. With cache_dir, completions are reused from there when
    everything they are a function of is the same (eval_rollouts); time/eval_s is the wall time of it all."""
    t0 = time.perf_counter()
    digest = model_digest(model, tokenizer) if cache_dir else None
    memo = (cache_dir, digest) if digest else None
    sets = {"eval/": task.test, **{f"eval/{name}/": data for name, data in task.extra_tests.items()}}
    metrics = {}
    for prefix, data in sets.items():
        metrics.update(evaluate_set(model, tokenizer, task, data, prefix, n, k, max_new_tokens, temperature, eos_ids,
                                    device, seed, rank, world, batch_size, top_k, top_p, memo))
    return {**metrics, "time/eval_s": time.perf_counter() - t0}


def eval_rollouts(model, tokenizer, task, data, idx: list[int], n: int, max_new_tokens: int, temperature: float,
                  eos_ids: list[int], device, seed: int, batch_size: int | None = None, top_k: int = 0, top_p: float = 1.0,
                  memo: tuple[str, str] | None = None):
    """The evaluation's completions of data's rows idx, scored: n samples each with keys (seed, EVAL_KEY, row,
    sample), the same draws at every evaluation and for every model, and one greedy completion each (single-turn,
    untruncated: in one batch with the samples, each row at its own temperature; the same tokens as two passes up to
    rounding, for less than the greedy pass's own decoding: a larger batch's products run nearer their rate). Returns the
    sampled Rollout (row-major: a prompt's n samples together), their rewards and successes, and the greedy
    completions' successes. With memo = (directory, model_digest) the two Rollouts of a single-turn task are kept in
    that directory under the hash of the digest and this call's arguments, and reused (every arm of a study evaluates
    its base model once); they are scored again each time."""
    shard = data.select(idx)
    prompts, answers = list(shard["prompt"]), list(shard["answer"])
    repeated = [a for a in answers for _ in range(n)]
    keys = [(seed, EVAL_KEY, i, j) for i in idx for j in range(n)]
    single_turn = task.envs(answers[:1]) is None

    def sample_both() -> tuple[Rollout, Rollout]:
        if single_turn and top_k == 0 and top_p == 1.0:  # the greedy rows (untruncated) ride along with the samples
            both = rollout(model, tokenizer, [*(p for p in prompts for _ in range(n)), *prompts],
                           [*keys, *[(0,)] * len(prompts)], max_new_tokens, [temperature] * len(keys) + [0.0] * len(prompts),
                           eos_ids, device, None, batch_size)
            return select_rows(both, list(range(len(keys)))), select_rows(both, list(range(len(keys), len(both.texts))))
        sampled = rollout(model, tokenizer, [p for p in prompts for _ in range(n)], keys, max_new_tokens, temperature,
                          eos_ids, device, task.envs(repeated), batch_size, top_k, top_p)
        greedy = rollout(model, tokenizer, prompts, [(0,)] * len(prompts), max_new_tokens, 0.0, eos_ids, device,
                         task.envs(answers), batch_size)
        return sampled, greedy

    flags = (prompts, answers, keys, max_new_tokens, temperature, eos_ids, str(device), batch_size, top_k, top_p)
    if memo is None or not single_turn:  # multi-turn: the environments' rewards ride along, not kept
        sampled, greedy = sample_both()
    else:
        key = hashlib.sha256((memo[1] + repr(flags)).encode()).hexdigest()
        sampled, greedy = memoised(Path(memo[0]) / f"{key}.pt", sample_both, device)
    rewards, successes = task.score(sampled, repeated, shard)
    _, greedy_successes = task.score(greedy, answers, shard)
    return sampled, rewards, successes, greedy_successes


SAMPLER_CODE = ("sampling.py", "multiturn.py", "rollout.py", "models.py")  # the code that turns weights, prompts, uniforms into tokens
SAMPLER_TEXT = [(Path(__file__).parent / f).read_text() for f in SAMPLER_CODE]  # as imported: a later edit is not this run's code


def model_digest(model, tokenizer) -> str | None:
    """sha256 of everything but its own arguments that a rollout of this model is a function of: every weight and
    buffer (name, dtype, shape, bytes), the model's class, config and autocast dtype (--dtype bfloat16 keeps float32
    weights), which forward its linear layers run (torch's or oneDNN's products: common.models.onednn_linears), the tokenizer (its whole definition where it has one, else its vocabulary; pad id, chat template), the
    sampler's source code and the torch, transformers and numpy releases. None for sharded weights (FSDP: no whole
    copy to hash)."""
    import transformers

    inner = base_model(model)
    h = hashlib.sha256()
    for name, value in inner.state_dict().items():
        if type(value) is not torch.Tensor:  # a DTensor shard
            return None
        h.update(f"{name} {value.dtype} {tuple(value.shape)}".encode())
        h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(repr((type(inner).__name__, inner.config.to_json_string(), str(getattr(inner, "autocast_dtype", None)),
                   backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
                   sorted({getattr(m.forward, "func", m.forward).__name__ for m in inner.modules()
                           if type(m) is torch.nn.Linear}),  # the kernel
                   tokenizer.pad_token_id, getattr(tokenizer, "chat_template", None), torch.__version__,
                   transformers.__version__, np.__version__, SAMPLER_TEXT)).encode())
    return h.hexdigest()


def memoised(path: Path, fn, device) -> tuple:
    """fn()'s Rollouts, loaded onto device from path if an earlier call saved them there, else computed and saved
    (written to a temporary file and renamed: a crash leaves no half-written entry; one that cannot be read is
    computed again and replaced)."""
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
        return tuple(Rollout(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in r.items()})
                     for r in saved)
    except Exception:  # not there, or unreadable
        pass
    rollouts = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save([{f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout)} for r in rollouts], tmp)
    os.replace(tmp, path)
    return rollouts


def evaluate_set(model, tokenizer, task, data, prefix: str, n: int, k: int, max_new_tokens: int, temperature: float,
                 eos_ids: list[int], device, seed: int, rank: int = 0, world: int = 1, batch_size: int | None = None,
                 top_k: int = 0, top_p: float = 1.0, memo: tuple[str, str] | None = None) -> dict[str, float]:
    """evaluate() on one held-out Dataset, its metrics named prefix + name. pass@1_se and greedy_se are the standard
    errors of the mean over prompts (pass@1: the spread of the per-prompt pass@1 over sqrt(prompts))."""
    from accelerate.utils import gather_object

    idx = list(range(rank, len(data), world))
    sampled, rewards, successes, greedy_successes = eval_rollouts(model, tokenizer, task, data, idx, n, max_new_tokens,
                                                                  temperature, eos_ids, device, seed, batch_size, top_k, top_p,
                                                                  memo)
    per_prompt = [(sum(successes[j * n : (j + 1) * n]), sum(rewards[j * n : (j + 1) * n]) / n,
                   float(greedy_successes[j])) for j in range(len(idx))]
    lengths = sampled.completion_mask.sum(-1).tolist()  # tokens after the prompt that the model wrote
    formatted = task.formatted_rows(sampled) if task.formatted is not None else []
    shards = [(per_prompt, lengths, formatted)]
    shards = gather_object(shards) if world > 1 else shards
    per_prompt = [x for shard, _, _ in shards for x in shard]
    lengths = [x for _, shard, _ in shards for x in shard]
    formatted = [x for _, _, shard in shards for x in shard]
    m = len(per_prompt)
    pass1 = np.array([pass_at_k(n, c, 1) for c, _, _ in per_prompt])
    greedy_rate = sum(g for _, _, g in per_prompt) / m
    metrics = {
        "pass@1": pass1.mean(),
        "pass@1_se": pass1.std(ddof=1) / np.sqrt(m) if m > 1 else 0.0,
        "pass@k": sum(pass_at_k(n, c, k) for c, _, _ in per_prompt) / m,
        "greedy": greedy_rate,
        "greedy_se": float(np.sqrt(greedy_rate * (1 - greedy_rate) / m)),
        "reward_mean": sum(r for _, r, _ in per_prompt) / m,
        "mean_length": sum(lengths) / len(lengths),
    }
    if task.formatted is not None:  # e.g. gsm8k: the share of sampled completions that end with '#### N'
        metrics["format_rate"] = sum(formatted) / len(formatted)
    return {prefix + key: float(value) for key, value in metrics.items()}
