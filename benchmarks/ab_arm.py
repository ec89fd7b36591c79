"""One arm of an A/B timing, run in its own process: a checkout's sampler or training step, with or without
common.models.keep_freed_memory (glibc keeping freed blocks for reuse).

    for i in 1 2; do                              # alternating the arms; ~6 minutes
      python benchmarks/ab_arm.py /tmp/before off sample; python benchmarks/ab_arm.py . on sample
      python benchmarks/ab_arm.py . off sample; done
    for i in 1 2; do python benchmarks/ab_arm.py . off train; python benchmarks/ab_arm.py . on train; done

`sample`: 400 rows (100 held-out prompts x 4) x 24 new tokens at T 0.7, the evaluation's batch, timed twice;
`train`: token_logprobs with the entropy and its backward on 4 x 8 completions of 100 tokens, timed 3 times.
SmolLM2-135M-Instruct, float32. Prints the checkout, the malloc setting, the phase and the seconds of each repeat.
"""

import sys
import time
from pathlib import Path

import torch

root = str(Path(sys.argv[1]).resolve())
malloc, what = sys.argv[2] == "on", sys.argv[3]
sys.path.insert(0, root)
DATA = Path(__file__).resolve().parent.parent / "data" / "word_problems"
import common.models as M  # noqa: E402

if not malloc:
    M.keep_freed_memory = lambda: False  # (a checkout before it has none: off)
from common.models import eos_token_ids, load_model, load_tokenizer, resolve_model
from common.sampling import encode_prompts, row_uniforms, sample
from common.rollout import token_logprobs
from common.tasks import load_task
path = resolve_model("smollm2-135m-instruct", "gsm8k")
tok, model = load_tokenizer(path), load_model(path)
eos = eos_token_ids(model, tok)
task = load_task("gsm8k", str(DATA / "train.jsonl"), str(DATA / "test.jsonl"))
if what == "sample":
    B, T = 400, 24
    prompts = [p for p in task.test.select(range(B // 4))["prompt"] for _ in range(4)]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    u = row_uniforms([(0, i) for i in range(B)], T, "cpu")
    model.eval()
    ts = []
    for _ in range(2):
        t = time.perf_counter(); sample(model, ids, mask, T, 0.7, eos, tok.pad_token_id, u); ts.append(time.perf_counter() - t)
    print(root, malloc, what, [round(x, 1) for x in ts])
else:
    prompts = [p for p in task.train.select(range(4))["prompt"] for _ in range(8)]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    u = row_uniforms([(0, i) for i in range(32)], 100, "cpu")
    model.eval()
    out, _ = sample(model, ids, mask, 100, 0.7, eos, tok.pad_token_id, u)
    cm = torch.ones_like(out)
    model.train()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        lp, ent = token_logprobs(model, ids, mask, out, cm, 0.7, True)
        (lp * cm).sum().backward()
        ts.append(time.perf_counter() - t)
    print(root, malloc, what, [round(x, 1) for x in ts])
