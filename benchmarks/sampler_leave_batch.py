"""The sampling phase of a real-model study with and without ended rows leaving the decoding batch.

    python benchmarks/sampler_leave_batch.py              # ~6 minutes on 2 CPU cores

SmolLM2-135M-Instruct (float32) on the offline word problems, sampled as the staleness study samples: a training
batch (4 prompts x 8 completions at T 0.7, <= 128 new tokens, the recipe's) and an evaluation batch (16 held-out
prompts x 4 samples at T 0.7, and the same 16 greedy). Two arms on the same prompts and uniforms, alternating which
goes first, --rounds rounds: `whole` keeps every row in the batch to the last step (leave_batch=None, the sampler
before); `leave` drops the rows that ended once they are a quarter of the batch (common.sampling.LEAVE_BATCH). The
tokens are those of one batch up to rounding: the rows whose tokens differ are counted (a draw within rounding of a
CDF boundary flips; greedy: a near-tie). Each arm's time against the sampling floor of benchmarks/real_model_steps.py
(the prompts' arithmetic, then per decode step the weights and the running rows' caches read once), measured in the
same run. Writes benchmarks/results/sampler_leave_batch.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_model_steps import Floors, matmul_rate, read_bandwidth  # noqa: E402

from common import word_problems  # noqa: E402
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model  # noqa: E402
from common.sampling import LEAVE_BATCH, completion_mask, encode_prompts, row_uniforms, sample  # noqa: E402
from common.tasks import load_task  # noqa: E402

ARMS = {"whole": None, "leave": LEAVE_BATCH}


@dataclass
class Args:
    rounds: int = 3
    max_new_tokens: int = 128
    temperature: float = 0.7
    data_dir: str = "data/word_problems"


def main(args: Args) -> None:
    if not (Path(args.data_dir) / "train.jsonl").is_file():
        word_problems.write(args.data_dir)
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    eos = eos_token_ids(model, tokenizer)
    task = load_task("gsm8k", f"{args.data_dir}/train.jsonl", f"{args.data_dir}/test.jsonl")
    config = model.config
    floors = Floors(config, matmul_rate("cpu", torch.float32, config.hidden_size, config.intermediate_size),
                    read_bandwidth("cpu"), 4)
    held_out = list(task.test.select(range(16))["prompt"])
    batches = {  # name: (prompts, temperature)
        "training (4 x 8, T 0.7)": ([p for p in task.train.select(range(4))["prompt"] for _ in range(8)], args.temperature),
        "evaluation sampled (16 x 4, T 0.7)": ([p for p in held_out for _ in range(4)], args.temperature),
        "evaluation greedy (16)": (held_out, 0.0),
    }
    results = {}
    for name, (prompts, temperature) in batches.items():
        ids, mask = encode_prompts(tokenizer, prompts, "cpu")
        uniforms = row_uniforms([(0, 7, i) for i in range(len(prompts))], args.max_new_tokens, "cpu")
        times, out = {arm: [] for arm in ARMS}, {}
        for r in range(args.rounds):
            for arm in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):  # alternate which goes first
                t0 = time.perf_counter()
                tokens, _ = sample(model, ids, mask, args.max_new_tokens, temperature, eos, tokenizer.pad_token_id,
                                   uniforms, leave_batch=ARMS[arm])
                times[arm].append(time.perf_counter() - t0)
                out[arm] = tokens
        lengths = completion_mask(out["whole"], eos)[0].sum(-1).tolist()
        a, b = out["whole"], out["leave"]
        width = max(a.shape[1], b.shape[1])
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=tokenizer.pad_token_id)  # noqa: E731
        flipped = int((pad(a) != pad(b)).any(-1).sum())
        groups = [[i for i, q in enumerate(prompts) if q == p] for p in dict.fromkeys(prompts)]  # each prompt runs once
        floor = floors.sampling([int(mask[g[0]].sum()) for g in groups], [[lengths[i] for i in g] for g in groups])
        results[name] = (times, lengths, flipped, len(prompts), floor)
    lines = ["| batch | rows | mean / max length | whole (s) | leave (s) | leave / whole | floor (s) | rows whose tokens differ |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (times, lengths, flipped, rows, floor) in results.items():
        whole, leave = statistics.median(times["whole"]), statistics.median(times["leave"])
        lines.append(f"| {name} | {rows} | {statistics.mean(lengths):.0f} / {max(lengths)} | {whole:.2f} | {leave:.2f} | "
                     f"{leave / whole:.2f}x | {floor:.2f} | {flipped} |")
    text = (f"SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads; medians of {args.rounds} alternating "
            f"rounds (`python benchmarks/sampler_leave_batch.py`)\n\n" + "\n".join(lines) + "\n")
    print(text)
    (ROOT / "benchmarks" / "results" / "sampler_leave_batch.md").write_text(text)


if __name__ == "__main__":
    main(tyro.cli(Args))
