"""What fits where: an estimate of a GRPO step's peak GPU memory for 0.5B, 1.5B and 7B models by option.

    python benchmarks/projection.py          # instant; writes benchmarks/results/projection.md

An estimate from counting bytes, not a measurement (no GPU was lent to measure one). The counts are those of
postrl's code paths (common/models.py, common/rollout.py) under bf16 mixed precision; the one empirical
constant, activation bytes per token, is the count that matches the SmolLM2-135M-Instruct measurement of
`benchmarks/throughput.py --mode memory` (printed side by side below when benchmarks/results/memory.md exists).

Per parameter P (bytes):
  full fine-tuning    16 P   float32 weights, gradients, AdamW m and v
                     + 2 P   autocast's bf16 copies of the weights, saved by the forward for the backward
  reference (beta>0)   4 P   loaded exactly as the policy (float32; see common/models.py: load_reference)
  LoRA                 4 P   the frozen base in float32 (2 P with --pure-dtype) + 2 P autocast copies (none with
                             --pure-dtype); adapters and their AdamW state ~1 % of that; the reference is free
  FSDP over N GPUs    16 P / N, + 2 P autocast copies (unsharded: saved for the backward), + 4 P while a rollout
                             gathers the full weights (common/sampling.py: full_parameters) and the reference
                             unsharded (4 P, beta > 0)
Per token of a training micro-batch (B rows x S = prompt + completion tokens), L layers, hidden h, MLP width I:
  activations        (10 h + 5 I) elements per layer (the two norms' inputs and outputs, q k v after RoPE, the
                             attention output and its reshaped copy; the MLP's input and its five (B, S, I) tensors
                             less one shared), 2 bytes each in bf16 (4 in float32); the count that matches the
                             SmolLM2 measurement to within 5 %; with --gradient-checkpointing only
                             each layer's float32 input (4 h bytes) plus one layer's activations
  logits             per completion token: V x 14 bytes (bf16 logits, float32 logits / T, log-softmax, and its
                             gradient)
Sampling (--generation-batch-size R rows): the KV cache R x S x L x 2 x kv_heads x head_dim x 2 bytes, and R x V
float32 logits per decoded token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GB = 1e9


@dataclass
class Arch:  # from each model's published config.json
    name: str
    params: float
    layers: int
    hidden: int
    mlp: int
    kv_heads: int
    head_dim: int
    vocab: int


MODELS = [
    Arch("Qwen2.5-0.5B", 0.494e9, 24, 896, 4864, 2, 64, 151936),
    Arch("Qwen2.5-1.5B", 1.54e9, 28, 1536, 8960, 2, 128, 151936),
    Arch("Qwen2.5-7B", 7.62e9, 28, 3584, 18944, 4, 128, 152064),
]
SMOLLM2 = Arch("SmolLM2-135M-Instruct", 0.1345e9, 30, 576, 1536, 3, 64, 49152)


@dataclass
class Work:
    prompt: int = 256  # tokens, chat template included
    completion: int = 768  # --max-new-tokens
    rows: int = 8  # completions per training forward (rows per step / --minibatches)
    generation_rows: int = 64  # --generation-batch-size
    activation_bytes: int = 2  # bf16 autocast; 4 in float32


OPTIONS = {  # label: (bytes per parameter held on one GPU of `gpus`, autocast copies saved for the backward, gpus, checkpointing)
    "full, beta 0.04 (reference)": (lambda g: 16 + 4, 2, 1, False),
    "full, beta 0": (lambda g: 16, 2, 1, False),
    "full, beta 0, + gradient checkpointing": (lambda g: 16, 2, 1, True),
    "LoRA r 16 + gradient checkpointing (any beta)": (lambda g: 4, 2, 1, True),
    "LoRA + --pure-dtype (bf16 base) + gradient checkpointing": (lambda g: 2, 0, 1, True),
    "FSDP on 8, beta 0.04, + gradient checkpointing": (lambda g: 16 / g + 4, 2, 8, True),
    "FSDP on 8, beta 0, + gradient checkpointing": (lambda g: 16 / g, 2, 8, True),
}


def activations(a: Arch, w: Work, checkpointing: bool) -> float:
    tokens = w.rows * (w.prompt + w.completion)
    per_layer = (10 * a.hidden + 5 * a.mlp) * w.activation_bytes
    kept = tokens * (4 * a.hidden * a.layers + per_layer) if checkpointing else tokens * per_layer * a.layers
    return kept + w.rows * w.completion * a.vocab * 14


def sampling(a: Arch, w: Work) -> float:
    kv = w.generation_rows * (w.prompt + w.completion) * a.layers * 2 * a.kv_heads * a.head_dim * 2
    return kv + w.generation_rows * a.vocab * 4 * 2


def estimate(a: Arch, w: Work, option: str) -> tuple[float, float]:
    """(training peak, sampling peak) in bytes on one GPU."""
    held, copies, gpus, checkpointing = OPTIONS[option]
    weights = held(gpus) * a.params
    gathered = 4 * a.params if gpus > 1 else 0  # a rollout under FSDP holds the full float32 weights
    return weights + copies * a.params + activations(a, w, checkpointing), weights + gathered + sampling(a, w)


def measured_smollm2() -> tuple[float, str] | None:
    """The float32 row of benchmarks/results/memory.md: peak RSS in MB, and its command."""
    path = RESULTS / "memory.md"
    if not path.is_file():
        return None
    text = path.read_text()
    row = re.search(r"^\| float32 \| ([\d.e+]+)", text, re.M)
    return (float(row.group(1)), text.splitlines()[0]) if row else None


def main() -> None:
    w = Work()
    lines = [f"`python benchmarks/projection.py`: an estimate, not a measurement. Work: prompts of {w.prompt} tokens, "
             f"completions of {w.completion}, {w.rows} completions per training forward, sampling {w.generation_rows} rows "
             f"at a time, bf16 mixed precision. GB = 1e9 bytes; peak = the larger of the training and sampling peaks; "
             f"fits = under 72 GB (80 GB less 10 % for the allocator and CUDA context).", "",
             "| options | " + " | ".join(f"{a.name}: peak GB (train / sample), fits 80 GB?" for a in MODELS) + " |",
             "|---" * (len(MODELS) + 1) + "|"]
    for option in OPTIONS:
        cells = []
        for a in MODELS:
            train, sample = estimate(a, w, option)
            peak = max(train, sample) / GB
            cells.append(f"{peak:.0f} ({train / GB:.0f} / {sample / GB:.0f}) {'yes' if peak < 72 else 'no'}")
        lines.append(f"| {option} | " + " | ".join(cells) + " |")
    measured = measured_smollm2()
    if measured:  # the check on the counts: the same arithmetic on the measured float32 CPU run
        small = Work(prompt=80, completion=64, rows=16, generation_rows=16, activation_bytes=4)
        state = (16 + 4) * SMOLLM2.params  # float32: no autocast copies; beta 0.04: a float32 reference
        train = state + activations(SMOLLM2, small, False)
        lines += ["", f"Check against a measurement: SmolLM2-135M-Instruct in float32 on the CPU, 16 completions of <= 64 "
                      f"tokens after ~80-token prompts, beta 0.04: the counts give {train / 1e6:.0f} MB for the training "
                      f"peak; measured peak RSS {measured[0]:.0f} MB, which also holds the torch and transformers runtime "
                      f"(about 0.5 GB) and allocator slack ({measured[1].split(':')[0]})."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "projection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
