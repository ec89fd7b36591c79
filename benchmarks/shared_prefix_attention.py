"""A decode step's attention with each group's prompt read once, against transformers' own, before building it.

    python benchmarks/shared_prefix_attention.py           # ~2 minutes on 2 CPU cores, nothing else running

The sampler gives every row its own copy of its prompt's keys and values (common.sampling.PreallocatedLayer), so at
each decode step a group's G rows read the same prompt G times, in every layer. The alternative measured here keeps
each distinct prompt's keys and values once, (P, H_kv, L_p, D), beside the rows' own generated ones, (B, H_kv, t, D),
and computes one softmax over both:

    s_b = [q_b K_prompt(b)^T, q_b K_b^T] * scaling + mask_b        p_b = softmax(s_b)
    o_b = p_b[:L_p] V_prompt(b) + p_b[L_p:] V_b

with the prompt part of a group's G rows (and their g query heads per key/value head) in one product against that
prompt's keys: (G g x D) @ (D x L_p), read once. Shapes are SmolLM2-135M-Instruct's (9 query heads on 3 key/value
heads of 64, 30 layers) and the staleness study's batches: the word problems' prompts with the chat template, left
padded as the sampler pads them, a training batch (4 prompts x 8) and an evaluation batch (100 prompts x 5: 4 samples
and the greedy row). Both arms get the same random queries, keys and values; each arm's output is compared with
transformers' sdpa_attention_forward (the function SmolLM2's layers call). Writes
benchmarks/results/shared_prefix_attention.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "repro"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_profile import prompts  # noqa: E402
from runner import cpu_model  # noqa: E402

from common.models import load_tokenizer, resolve_model  # noqa: E402
from common.sampling import encode_prompts  # noqa: E402

H, H_KV, D, LAYERS = 9, 3, 64, 30


@dataclass
class Args:
    positions: tuple[int, ...] = (1, 64, 128)
    """generated positions t at which a decode step is timed"""
    repeats: int = 20
    name: str = "shared_prefix_attention"


def shared_prefix_attention(query, prefix_keys, prefix_values, rows, keys, values, mask, scaling):
    """query (B, H, 1, D); the distinct prompts' keys and values (P, H_kv, L_p, D); rows (B,) each row's prompt; the
    rows' generated keys and values (B, H_kv, t, D); mask (B, 1, 1, L_p + t), True where a row attends."""
    B, P, L_p = len(query), len(prefix_keys), prefix_keys.shape[2]
    g = H // H_KV
    counts = torch.bincount(rows, minlength=P)
    G = int(counts.max())
    order = torch.argsort(rows, stable=True)
    slot = torch.arange(B) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)  # place in its group
    flat = torch.empty(B, dtype=torch.long)
    flat[order] = rows[order] * G + slot  # row b's place in the (P x G) grid of groups
    q = query.reshape(B, H_KV, g, D)
    grid = q.new_zeros(P * G, H_KV, g, D).index_copy(0, flat, q)  # absent slots stay zero
    grid = grid.reshape(P, G, H_KV, g, D).transpose(1, 2).reshape(P, H_KV, G * g, D)
    prompt_scores = (grid @ prefix_keys.transpose(-1, -2)).reshape(P, H_KV, G, g, L_p).transpose(1, 2)
    prompt_scores = prompt_scores.reshape(P * G, H_KV, g, L_p)[flat]  # (B, H_kv, g, L_p)
    scores = torch.cat([prompt_scores, q @ keys.transpose(-1, -2)], dim=-1) * scaling
    scores = scores.masked_fill(~mask.reshape(B, 1, 1, -1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p_prompt = p.new_zeros(P * G, H_KV, g, L_p).index_copy(0, flat, p[..., :L_p].contiguous())
    p_prompt = p_prompt.reshape(P, G, H_KV, g, L_p).transpose(1, 2).reshape(P, H_KV, G * g, L_p)
    out = (p_prompt @ prefix_values).reshape(P, H_KV, G, g, D).transpose(1, 2).reshape(P * G, H_KV, g, D)[flat]
    out = out + p[..., L_p:] @ values
    return out.reshape(B, 1, H, D)  # as transformers returns it: (B, query positions, heads, D)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(prompt_mask: torch.Tensor, G: int, t: int, repeats: int) -> tuple[float, float, float]:
    """(ms a decode step over 30 layers: transformers' own, shared prompt; the largest difference in the output)."""
    gen = torch.Generator().manual_seed(t)
    P, L_p = prompt_mask.shape
    B = P * G
    rows = torch.arange(P).repeat_interleave(G)
    prefix_keys, prefix_values = torch.randn(P, H_KV, L_p, D, generator=gen), torch.randn(P, H_KV, L_p, D, generator=gen)
    keys, values = torch.randn(B, H_KV, t, D, generator=gen), torch.randn(B, H_KV, t, D, generator=gen)
    query = torch.randn(B, H, 1, D, generator=gen)
    mask = torch.cat([prompt_mask[rows].bool(), torch.ones(B, t, dtype=torch.bool)], dim=1)[:, None, None, :]
    copied_keys = torch.cat([prefix_keys[rows], keys], dim=2)  # what the sampler's cache holds today
    copied_values = torch.cat([prefix_values[rows], values], dim=2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = H // H_KV, True
    scaling = D**-0.5
    own = lambda: sdpa_attention_forward(module, query, copied_keys, copied_values, mask, scaling=scaling)[0]  # noqa: E731
    shared = lambda: shared_prefix_attention(query, prefix_keys, prefix_values, rows, keys, values, mask, scaling)  # noqa: E731
    difference = (own() - shared()).abs().max().item()
    return LAYERS * median_ms(own, repeats), LAYERS * median_ms(shared, repeats), difference


def main(args: Args) -> None:
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct", "gsm8k"))
    problems = prompts(100)
    batches = {"training (4 x 8)": (problems[:4], 8), "evaluation (100 x 5)": (problems, 5)}
    lines = [f"`python benchmarks/shared_prefix_attention.py`: SmolLM2-135M-Instruct's attention shapes (9 query heads "
             f"on 3 key/value heads of 64, 30 layers), float32, {torch.get_num_threads()} threads, {cpu_model()}; "
             f"median of {args.repeats}", "",
             "| batch | rows | prompt positions | t | transformers' own, each row's copy (ms a step) | "
             "each prompt once (ms a step) | shared / own | largest difference |", "|---|---|---|---|---|---|---|---|"]
    for name, (rows, G) in batches.items():
        _, prompt_mask = encode_prompts(tokenizer, rows, "cpu")
        for t in args.positions:
            own, shared, diff = measure(prompt_mask, G, t, args.repeats)
            lines.append(f"| {name} | {len(rows) * G} | {prompt_mask.shape[1]} | {t} | {own:.1f} | {shared:.1f} | "
                         f"{shared / own:.2f}x | {diff:.1e} |")
            print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
