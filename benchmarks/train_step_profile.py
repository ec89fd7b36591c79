"""One training step of SmolLM2 (token_logprobs with the entropy, and its backward) profiled by torch.profiler:
where a step's time goes, op by op and by shape.

    python benchmarks/train_step_profile.py      # ~2 minutes

The recipe's batch: 4 training prompts x 8 completions of 100 tokens sampled at T 0.7 (float32, 2 threads); two
warm-up steps, then one profiled. Prints the step's time and the ops with the most self time (grouped by name, then
by input shape).
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.sampling import encode_prompts, row_uniforms, sample
from common.rollout import token_logprobs
from common.tasks import load_task
path = resolve_model("smollm2-135m-instruct", "gsm8k")
tok, model = load_tokenizer(path), load_model(path)
eos = eos_token_ids(model, tok)
task = load_task("gsm8k", str(ROOT / "data/word_problems/train.jsonl"), str(ROOT / "data/word_problems/test.jsonl"))
prompts = [p for p in task.train.select(range(4))["prompt"] for _ in range(8)]
ids, mask = encode_prompts(tok, prompts, "cpu")
u = row_uniforms([(0, i) for i in range(32)], 100, "cpu")
model.eval()
out, _ = sample(model, ids, mask, 100, 0.7, eos, tok.pad_token_id, u)
cm = torch.ones_like(out)
model.train()
def step():
    lp, ent = token_logprobs(model, ids, mask, out, cm, 0.7, True)
    (lp * cm).sum().backward()
step(); step()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    t = time.perf_counter(); step(); print("step", time.perf_counter() - t)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=45))
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40, max_shapes_column_width=60))
