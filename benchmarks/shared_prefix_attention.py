"""A decode step's attention with each group's prompt read once (common.sampling.prompt_once), against transformers' own.

    python benchmarks/shared_prefix_attention.py           # ~3 minutes on 2 CPU cores, nothing else running

The sampler gives every row its own copy of its prompt's keys and values (common.sampling.PreallocatedLayer), so at
each decode step a group's G rows read the same prompt G times, in every layer. A batch of at least
SHARED_PROMPT_ROWS rows keeps each distinct prompt's keys and values once instead (SharedPromptLayer), beside the rows'
own generated ones, and its attention (prompt_once) softmaxes the two parts apart and merges them by their
log-sum-exps, the prompt part of a group's G rows (and their g query heads per key/value head) in one product against
that prompt's keys: (G g x D) @ (D x L_p), read once. Three arms on the same random queries, keys and values:
transformers' sdpa_attention_forward on each row's copy (what the sampler runs below the threshold), prompt_once with
each prompt once, and prompt_once on each row's copy (every row its own "prompt": the same arithmetic without the
sharing, which tells what the sharing itself saves). Shapes are SmolLM2-135M-Instruct's (9 query heads on 3 key/value
heads of 64, 30 layers) and the staleness study's: the word problems' prompts with the chat template, left padded as
the sampler pads them; a training batch (4 prompts x 8), an evaluation batch (100 prompts x 5: 4 samples and the
greedy row) and two sizes between, to place the threshold. Each arm's output is compared with transformers'. Writes
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
from common.sampling import SHARED_PROMPT_ROWS, SharedPromptLayer, encode_prompts, prompt_once  # noqa: E402

H, H_KV, D, LAYERS = 9, 3, 64, 30


@dataclass
class Args:
    positions: tuple[int, ...] = (1, 64, 128)
    """generated positions t at which a decode step is timed"""
    repeats: int = 20
    name: str = "shared_prefix_attention"


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(prompt_mask: torch.Tensor, G: int, t: int, repeats: int) -> tuple[float, float, float, float, float]:
    """ms a decode step over 30 layers (transformers' own, prompt_once with each prompt once, prompt_once on each row's
    copy) and the largest difference of the two prompt_once arms from transformers' output."""
    gen = torch.Generator().manual_seed(t)
    P, L_p = prompt_mask.shape
    B = P * G
    rows = torch.arange(P).repeat_interleave(G)
    prefix_keys, prefix_values = torch.randn(P, H_KV, L_p, D, generator=gen), torch.randn(P, H_KV, L_p, D, generator=gen)
    keys, values = torch.randn(B, H_KV, t, D, generator=gen), torch.randn(B, H_KV, t, D, generator=gen)
    query = torch.randn(B, H, 1, D, generator=gen)
    mask = torch.cat([prompt_mask[rows].bool(), torch.ones(B, t, dtype=torch.bool)], dim=1)[:, None, None, :]
    once = SharedPromptLayer(prefix_keys, prefix_values, t, rows)
    once.update(keys, values)
    copied_keys, copied_values = once.copies()  # what the sampler's cache holds below the threshold
    each = SharedPromptLayer(copied_keys[:, :, :L_p], copied_values[:, :, :L_p], t, torch.arange(B))
    each.update(keys, values)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = H // H_KV, True
    scaling = D**-0.5
    arms = {"own": lambda: sdpa_attention_forward(module, query, copied_keys, copied_values, mask, scaling=scaling)[0],
            "once": lambda: prompt_once(query, once, once.keys, once.values, mask, scaling),
            "each": lambda: prompt_once(query, each, each.keys, each.values, mask, scaling)}
    reference = arms["own"]()
    differences = [(arms[a]() - reference).abs().max().item() for a in ("once", "each")]
    times = {a: LAYERS * median_ms(fn, repeats) for a, fn in arms.items()}
    return times["own"], times["once"], times["each"], *differences


def main(args: Args) -> None:
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct", "gsm8k"))
    problems = prompts(100)
    batches = {"training (4 x 8)": (problems[:4], 8), "16 x 8": (problems[:16], 8), "50 x 5": (problems[:50], 5),
               "evaluation (100 x 5)": (problems, 5)}
    lines = [f"`python benchmarks/shared_prefix_attention.py`: SmolLM2-135M-Instruct's attention shapes (9 query heads "
             f"on 3 key/value heads of 64, 30 layers), float32, {torch.get_num_threads()} threads, {cpu_model()}; "
             f"median of {args.repeats}; the sampler holds each prompt once from {SHARED_PROMPT_ROWS} rows", "",
             "| batch | rows | prompt positions | t | transformers' own, each row's copy (ms a step) | "
             "prompt_once, each prompt once (ms a step) | once / own | prompt_once on each row's copy (ms a step) | "
             "largest difference (once, each) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (rows, G) in batches.items():
        _, prompt_mask = encode_prompts(tokenizer, rows, "cpu")
        for t in args.positions:
            own, once, each, d_once, d_each = measure(prompt_mask, G, t, args.repeats)
            lines.append(f"| {name} | {len(rows) * G} | {prompt_mask.shape[1]} | {t} | {own:.1f} | {once:.1f} | "
                         f"{once / own:.2f}x | {each:.1f} | {d_once:.1e}, {d_each:.1e} |")
            print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.name}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
