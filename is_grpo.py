"""IS-GRPO: GRPO with importance-sampled prompts (after "Why GRPO needs normalization", Ge et al. 2026).

This file implements OUR READING OF THE PAPER'S ABSTRACT; the full paper (and its exact estimator)
was not available to us. The finding: dividing by the within-prompt reward std sigma_x acts as an
adaptive per-prompt step size, which is why GRPO converges faster than unnormalised REINFORCE; but
the expected GRPO update over uniformly drawn prompts,

    E_{x~D}[ grad J_x / sigma_x ],

points away from the full gradient E_{x~D}[grad J_x] whenever sigma_x varies across prompts.
The fix read here: draw prompts with probability proportional to sigma_x,

    q(x) = sigma_hat_x / sum_x' sigma_hat_x'         (sigma_hat: a running estimate, see below)

and keep the usual std-normalised GRPO update. Then

    E_{x~q}[ grad J_x / sigma_x ] = sum_x sigma_x / S * grad J_x / sigma_x = E_D[grad J_x] * |D| / S,

the direction of the full gradient, still with an adaptive step. Prompts whose G rewards are all
equal carry no gradient; drawing them less often wastes less compute.

sigma_hat_x is the std of the rewards of x's group on its last visits (an exponential average,
--sigma-decay), --sigma-init for prompts never drawn, and at least --sigma-floor, so that a prompt
whose group was all-equal is still drawn now and then and its estimate can recover. Prompts are
drawn with replacement (independent draws are what the identity above needs). With the full
5,000-prompt embedded pool most prompts are drawn once at most in 200 steps, so sampling stays close
to uniform; the estimates matter when prompts are revisited (`--train-size 512`, or several epochs).
Ablation (--prompt-weighting): uniform prompts as in grpo.py, each group's advantages multiplied by
sigma_x / mean(sigma) over the batch, which turns (R - mean) / sigma_x into (R - mean) / mean(sigma):
batch-std normalisation, the same expected direction without changing which prompts are drawn.

The loss is grpo.py's, unchanged. As there, with --num-iterations 1 the ratio is 1 and clipping never binds.

Run:
    python is_grpo.py                                     # the embedded job, offline
    python is_grpo.py --prompt-weighting                  # the ablation: uniform prompts, sigma weights
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import set_seed

from common.checkpoint import GracefulStop, export_model, find_checkpoint, load_state, run_dir_of, save_checkpoint
from common.cli import check, run
from common.engine import check_engine, micro_batch_mismatch, start_engine
from common.logging import MetricsWriter, device_memory, print_summary, progress_bar
from common.losses import aggregate, frac_zero_std, group_advantages, kl_estimate
from common.models import (eos_token_ids, load_policy, load_reference, load_tokenizer, optimizer_step, pure_dtype_warning,
                           resolve_model, trainable)
from common.multiturn import check_chat, trajectory_lengths, trajectory_metrics, turn_metrics, turn_stats
from common.rollout import evaluate, micro_batches, rollout, run_reach, runs_prompts_once, token_logprobs
from common.tasks import load_task


@dataclass
class Args:
    # ---------------------------------------------------------------- experiment
    seed: int = 0
    """seed of the prompt order, the sampling noise and the model's initial state"""
    run_name: str | None = None
    """name of the run directory under --output-dir (default: is_grpo__<task>__s<seed>__<unix time>)"""
    output_dir: str = "runs"
    """where runs are written: <output-dir>/<run-name>/{args.json, metrics.jsonl, checkpoints/}"""
    resume: str | None = None
    """resume from a run directory (its latest checkpoint) or a checkpoint directory; other flags must match the run"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: what accelerate picks (a GPU if there is one)"""
    # ---------------------------------------------------------------- model and task
    model: str = "embedded"
    """hub id or local directory; `embedded` is the tiny warm-started model of an embedded --task"""
    task: str = "reverse"
    """reverse | add | chain-N[-partial|-sum] (embedded, offline; chain: multi-turn) | gsm8k (hub or --data-path)"""
    data_path: str | None = None
    """gsm8k: a .json/.jsonl file with `question` and `answer` fields; math: MATH rows; data: any .json/.jsonl/.csv/.parquet"""
    train_size: int | None = None
    """use only the first N training prompts (default: all); a small pool is revisited often"""
    eval_data_path: str | None = None
    """held-out file of the same form (default: gsm8k's hub test split, or the last rows of --data-path)"""
    extra_eval_data_path: list[str] = field(default_factory=list)
    """more held-out files of that form, each evaluated too and logged as eval/<file name>/... (e.g. a transfer set)"""
    eval_fraction: float | None = None
    """math, data: hold out this fraction of --data-path's last rows (default: --eval-data-path, or its last rows)"""
    prompt_column: str = "prompt"
    """data: the column holding each prompt (text, or chat messages [{"role": ..., "content": ...}])"""
    answer_column: str = "answer"
    """data: the column the reward functions compare completions against"""
    reward: list[str] = field(default_factory=list)
    """reward functions by import path, module:function (several: --reward a:f b:g); replace the task's reward"""
    reward_weights: list[float] = field(default_factory=list)
    """weights of the --reward functions (default: 1 each); the reward is their weighted sum"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """compute dtype; bfloat16 = mixed precision: float32 weights and AdamW state, bf16 matrix products (autocast)"""
    pure_dtype: bool = False
    """opt-in: hold the trained weights and AdamW state in --dtype itself (no float32 master copy; at small
    learning rates most bf16 steps round away - a warning says how many)"""
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """also save the final policy in this dtype to <run>/export (checkpoints keep float32 weights: resume is exact)"""
    # ---------------------------------------------------------------- memory
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass instead of keeping them (less memory, about a third more compute; then
    transformers keeps no KV cache in training mode, so a group's prompt runs with each of its rows instead of once)"""
    lora_r: int = 0
    """LoRA rank; > 0 freezes the weights and trains adapters only, and pi_ref is the base with adapters off (no copy)"""
    lora_alpha: float = 16.0
    """LoRA scale alpha: the adapter adds (alpha / r) B A x"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    lora_target_modules: str = "all-linear"
    """comma-separated module names that get adapters (e.g. q_proj,v_proj), or all-linear"""
    generation_batch_size: int | None = None
    """sample (and evaluate) in micro-batches of this many rows (default: all at once); the same tokens up to
    rounding (other padding moves the logits by ~1e-6: a draw that close to a CDF boundary can flip)"""
    trust_remote_code: bool = False
    """let transformers run code shipped with a hub model"""
    # ---------------------------------------------------------------- rollout
    steps: int = 200
    """optimisation steps; each samples a fresh batch of prompts"""
    prompts_per_step: int = 32
    """prompts per step (global, over all processes)"""
    num_generations: int = 8
    """G: completions sampled per prompt (a group)"""
    max_new_tokens: int | None = None
    """completion budget (default: the task's)"""
    temperature: float = 1.0
    """sampling temperature; the training forward divides logits by it too, so ratios compare like with like"""
    top_p: float = 1.0
    """sample from the smallest set of most likely tokens whose probability reaches top_p (1: all); scored the same way"""
    top_k: int = 0
    """sample from the top_k most likely tokens only (0: all); scored the same way, so the first-pass ratio stays 1"""
    engine: Literal["hf", "vllm"] = "hf"
    """sampler of the rollouts: postrl's own, or vLLM in this process (common/engine.py; pip install -e '.[vllm]')"""
    # ---------------------------------------------------------------- algorithm
    lr: float = 5e-4
    """AdamW learning rate (5e-4 suits the embedded tiny model; ~1e-6 suits a 0.5B model)"""
    num_iterations: int = 1
    """mu in the paper: optimisation passes over each batch, pi_old fixed; > 1 makes clipping bind"""
    minibatches: int = 1
    """micro-batches per pass, each of whole groups (gradient accumulation; one optimiser step per pass, the same update)"""
    microbatch_tokens: int | None = None
    """or micro-batches by a token budget (verl's ppo_max_token_len_per_gpu): groups of like lengths, each micro-batch
    within this many tokens (its prompts once, its completions padded to its longest); the same update, less memory"""
    eps_low: float = 0.2
    """lower clip range: ratios below 1 - eps_low are clipped when A < 0"""
    eps_high: float = 0.2
    """upper clip range: ratios above 1 + eps_high are clipped when A > 0 (DAPO clip-higher: 0.28)"""
    beta: float = 0.04
    """KL coefficient against the reference model; 0 loads no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """estimator of KL(pi_theta || pi_ref) per token (k3 in the paper)"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how per-token losses are averaged: GRPO | DAPO | Dr. GRPO (see common/losses.py)"""
    sigma_init: float = 0.5
    """sigma_hat of a prompt never drawn: an optimistic prior, the std of a half-right binary group
    (0.5 as a population std; the unbiased std used here reaches 0.5 sqrt(G / (G - 1)), 0.535 at G = 8)"""
    sigma_floor: float = 0.05
    """smallest sigma_hat, so that all-equal prompts are still drawn now and then"""
    sigma_decay: float = 0.5
    """sigma_hat <- decay * sigma_hat + (1 - decay) * std of the new group (0: the last visit only)"""
    prompt_weighting: bool = False
    """ablation: uniform prompts, advantages weighted by sigma_x / mean(sigma) (batch-std normalisation)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    # ---------------------------------------------------------------- evaluation and logging
    eval_every: int = 10
    """evaluate every this many steps (and at step 0, the base policy, and at the last step); 0: only at the ends"""
    eval_samples: int = 8
    """n: samples per held-out prompt for pass@k"""
    eval_k: int = 8
    """k of eval/pass@k (k <= n)"""
    eval_prompts: int = 128
    """number of held-out prompts"""
    eval_cache: str | None = None
    """a directory where evaluation completions are kept under the hash of all they depend on (weights, prompts,
    draws, flags, sampler code) and reused: the arms of a study evaluate their common base model once"""
    save_every: int = 50
    """checkpoint every this many steps (and at the end, and on Ctrl-C)"""
    track: bool = False
    """log to Weights & Biases (pip install -e '.[track]')"""
    wandb_project: str = "postrl"
    """W&B project"""


# Flags that may differ between a run and its resumption.
RESUMABLE = {"resume", "export_dtype", "steps", "save_every", "eval_every", "track", "eval_cache", "device", "run_name", "output_dir",
             "extra_eval_data_path", "microbatch_tokens", "generation_batch_size"}


def check_args(args: Args, num_processes: int) -> None:
    check(args.num_generations >= 2, f"--num-generations must be at least 2 (got {args.num_generations}): "
                                     "a group needs two completions to have a baseline")
    check(args.beta >= 0, f"--beta must be >= 0 (got {args.beta})")
    check(0 < args.eps_low < 1, f"--eps-low must be in (0, 1) (got {args.eps_low})")
    check(args.eps_high > 0, f"--eps-high must be > 0 (got {args.eps_high})")
    check(0 < args.sigma_floor <= args.sigma_init, f"--sigma-floor must be in (0, --sigma-init] (got {args.sigma_floor})")
    check(0 <= args.sigma_decay < 1, f"--sigma-decay must be in [0, 1) (got {args.sigma_decay})")
    check(args.lr > 0, f"--lr must be > 0 (got {args.lr})")
    check(args.temperature > 0, f"--temperature must be > 0 (got {args.temperature})")
    check(0 < args.top_p <= 1 and args.top_k >= 0, f"--top-p must be in (0, 1] and --top-k >= 0 (got {args.top_p}, {args.top_k})")
    check(args.steps >= 1, f"--steps must be >= 1 (got {args.steps})")
    check(args.num_iterations >= 1, f"--num-iterations must be >= 1 (got {args.num_iterations})")
    check(args.max_new_tokens is None or args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    check(args.prompts_per_step >= 1 and args.prompts_per_step % num_processes == 0,
          f"--prompts-per-step ({args.prompts_per_step}) must be a positive multiple of the number of processes ({num_processes})")
    local_prompts = args.prompts_per_step // num_processes
    check(1 <= args.minibatches <= local_prompts, f"--minibatches must be in [1, {local_prompts}] (micro-batches hold whole "
                                                  f"groups: the prompts per process per step), got {args.minibatches}")
    check(args.microbatch_tokens is None or args.microbatch_tokens >= 1, "--microbatch-tokens must be >= 1")
    check(1 <= args.eval_k <= args.eval_samples, f"--eval-k must be in [1, --eval-samples={args.eval_samples}] (got {args.eval_k})")
    check(args.eval_every >= 0 and args.save_every >= 1 and args.eval_prompts >= 1,
          "--eval-every must be >= 0, --save-every and --eval-prompts >= 1")
    check(args.dtype != "float16", "--dtype float16 is not supported: fp16 training needs loss scaling, which postrl does "
                                   "not implement; use --dtype bfloat16 (GPUs from Ampere on, and CPUs) or float32")
    check(not args.pure_dtype or args.dtype != "float32", "--pure-dtype needs --dtype bfloat16 (float32 weights are already full precision)")
    check(args.lora_r >= 0 and args.lora_alpha > 0 and 0 <= args.lora_dropout < 1,
          "--lora-r must be >= 0, --lora-alpha > 0 and --lora-dropout in [0, 1)")
    check(args.generation_batch_size is None or args.generation_batch_size >= 1, "--generation-batch-size must be >= 1")
    check(args.data_path is None or os.path.isfile(args.data_path), f"--data-path {args.data_path}: no such file")
    check(args.eval_data_path is None or os.path.isfile(args.eval_data_path), f"--eval-data-path {args.eval_data_path}: no such file")
    for path in args.extra_eval_data_path:
        check(os.path.isfile(path), f"--extra-eval-data-path {path}: no such file")


def check_resume(args: Args, run_dir: Path) -> None:
    saved, default = json.loads((run_dir / "args.json").read_text()), asdict(Args())  # a flag added since: its default
    for key, value in asdict(args).items():
        check(key in RESUMABLE or saved.get(key, default[key]) == value,
              f"--{key.replace('_', '-')} is {value!r} but the run being resumed used {saved.get(key)!r}")


# ---------------------------------------------------------------- the prompt sampler
def prompt_probs(sigma_hat: np.ndarray, args: Args) -> np.ndarray:
    """q(x) proportional to sigma_hat_x (sigma_init where unseen, at least sigma_floor)."""
    sigma = np.where(np.isnan(sigma_hat), args.sigma_init, np.maximum(sigma_hat, args.sigma_floor))
    return sigma / sigma.sum()


def draw_prompts(sigma_hat: np.ndarray, args: Args, step: int) -> np.ndarray:
    """Step t's prompts (indices into the pool): --prompts-per-step independent draws from q, or for the ablation
    uniform draws without replacement (grpo.py's). They depend only on (seed, t) and sigma_hat, so resume and
    sharding see the same prompts."""
    rng = np.random.default_rng([args.seed, step])
    if args.prompt_weighting:
        return rng.choice(len(sigma_hat), args.prompts_per_step, replace=False)
    return rng.choice(len(sigma_hat), args.prompts_per_step, replace=True, p=prompt_probs(sigma_hat, args))


def update_sigma(sigma_hat: np.ndarray, chosen: np.ndarray, group_std: np.ndarray, decay: float) -> None:
    """Running estimate of each drawn prompt's reward std, in place: one update per distinct prompt,

        sigma_hat_x <- decay * sigma_hat_x + (1 - decay) * mean of the stds of x's groups in this batch

    (a prompt drawn m times in a batch gets one update, with its m groups' mean std; a prompt's first
    visit sets sigma_hat_x to that std)."""
    for x in np.unique(chosen):
        std = float(np.mean(group_std[chosen == x]))
        sigma_hat[x] = std if np.isnan(sigma_hat[x]) else decay * sigma_hat[x] + (1 - decay) * std


def is_advantages(rewards: torch.Tensor, group_size: int, prompt_weighting: bool) -> torch.Tensor:
    """GRPO's group-normalised advantages (R - mean_x) / (sigma_x + eps); for the ablation each group's multiplied by
    sigma_x / mean(sigma) over the batch, which makes them (R - mean_x) / mean(sigma): batch-std normalisation."""
    advantages = group_advantages(rewards, group_size, "group")
    if prompt_weighting:
        group_std = rewards.view(-1, group_size).std(dim=1)
        advantages = advantages * (group_std / group_std.mean().clamp(min=1e-8)).repeat_interleave(group_size)
    return advantages


# ---------------------------------------------------------------- the GRPO objective
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, args: Args, num_seqs, num_tokens, turn_ids=None, max_turns=1):
    """Clipped surrogate plus beta * KL, per token, aggregated with the whole batch's counts; with
    turn_ids (multi-turn), the clip and ratio statistics per model turn too."""
    ratio = torch.exp(logps - old_logps)  # r_it; == 1 on the first pass over a batch
    A = advantages[:, None]
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.eps_low, 1 + args.eps_high) * A)
    per_token = -surrogate
    if ref_logps is not None:
        per_token = per_token + args.beta * kl_estimate(logps, ref_logps, args.kl_estimator)
    loss = aggregate(per_token, mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)
    with torch.no_grad():  # token sums of the diagnostics; divided by the token count after the step
        m = mask.bool()
        clip_low = (ratio < 1 - args.eps_low) & (A < 0)  # the clip binds from below
        clip_high = (ratio > 1 + args.eps_high) & (A > 0)  # the clip binds from above
        stats = {
            "ratio": ratio[m].sum(),
            "clip_low": clip_low[m].sum(),
            "clip_high": clip_high[m].sum(),
            "approx_kl": kl_estimate(old_logps, logps, "k3")[m].sum(),  # KL(pi_old || pi_theta): (r - 1) - log r
            "ratio_min": ratio[m].min(), "ratio_max": ratio[m].max(),
        }
        if turn_ids is not None:
            stats["by_turn"] = turn_stats(ratio, clip_low | clip_high, turn_ids, max_turns)
    return loss, stats


def optimise(policy, ref, optimizer, accelerator, batch, advantages, args: Args, step: int) -> dict[str, float]:
    """num_iterations passes over the batch, each one optimiser step accumulated over micro-batches of whole groups.
    pi_old is the policy that sampled the batch: its log-probs are those of the first pass."""
    num_seqs = batch.completion_mask.shape[0] * accelerator.num_processes  # counts of the global batch
    num_tokens = accelerator.reduce(batch.completion_mask.sum().float(), "sum")
    micro = micro_batches(batch, args.num_generations, args.minibatches, args.microbatch_tokens,
                          runs_prompts_once(policy))  # the budget counts a prompt per group, or per row
    if args.microbatch_tokens and accelerator.num_processes > 1:  # as many forwards on every process (FSDP gathers in each)
        most = int(accelerator.gather(torch.tensor([len(micro)], device=accelerator.device)).max())
        micro = micro_batches(batch, args.num_generations, most, args.microbatch_tokens, runs_prompts_once(policy))
    ref_logps = [None] * len(micro)
    if ref is not None:  # pi_ref first (its logits never beside the policy's graph), under pi_theta's truncation
        with torch.no_grad():
            ref_logps = [token_logprobs(ref, *mb.inputs, args.temperature, False, args.top_k, args.top_p)[0] for mb in micro]
    old_logps, kl_ref, entropy = {}, 0.0, 0.0
    stats, grad_norms = [], []
    for iteration in range(args.num_iterations):
        for j, mb in enumerate(micro):  # attention on model and environment tokens; the loss on the model's only
            logps, token_entropy = token_logprobs(policy, *mb.inputs, args.temperature, iteration == 0, args.top_k, args.top_p)
            if iteration == 0:  # the sampling weights: pi_old, and the diagnostics measured at them
                old_logps[j] = logps.detach()
                entropy += (token_entropy * mb.completion_mask).sum()
                if ref is not None:
                    kl_ref += (kl_estimate(old_logps[j], ref_logps[j], args.kl_estimator) * mb.completion_mask).sum()
            loss, step_stats = grpo_loss(logps, old_logps[j], ref_logps[j], advantages[mb.rows], mb.completion_mask, args,
                                         num_seqs, num_tokens, mb.turn_ids, batch.max_turns)
            # DDP averages gradients over processes; the loss is already this process's share of the global sum
            with nullcontext() if j == len(micro) - 1 else accelerator.no_sync(policy):
                accelerator.backward(loss * accelerator.num_processes)
            stats.append({**step_stats, "loss": loss.detach()})
        pass_loss = sum(s["loss"] for s in stats[-len(micro):])  # this pass's loss: no NaN reaches the weights
        grad_norms.append(optimizer_step(optimizer, accelerator, policy, args.max_grad_norm, pass_loss, step))

    def total(values) -> float:  # summed over micro-batches, passes and processes
        return accelerator.reduce(torch.as_tensor(sum(values), dtype=torch.float32), "sum").item()

    def extreme(key: str, fn) -> float:
        return fn(accelerator.gather(fn(torch.stack([s[key] for s in stats])).reshape(1))).item()

    token_passes = num_tokens.item() * args.num_iterations
    metrics = {
        "loss": total(s["loss"] for s in stats) / args.num_iterations,
        "policy/entropy": total([entropy]) / num_tokens.item(),
        "policy/ratio_mean": total(s["ratio"] for s in stats) / token_passes,
        "policy/ratio_min": extreme("ratio_min", torch.min),
        "policy/ratio_max": extreme("ratio_max", torch.max),
        "policy/clip_frac_low": total(s["clip_low"] for s in stats) / token_passes,
        "policy/clip_frac_high": total(s["clip_high"] for s in stats) / token_passes,
        "policy/approx_kl": total(s["approx_kl"] for s in stats) / token_passes,
        "policy/grad_norm": torch.stack(grad_norms).mean().item(),
    }
    if args.engine == "vllm":  # the sampler's log-probs against the trainer's, same weights (this process's tokens)
        metrics.update(micro_batch_mismatch(micro, old_logps))
    if ref is not None:
        metrics["policy/kl_ref"] = total([kl_ref]) / num_tokens.item()
    if batch.turn_ids is not None:  # multi-turn: clipping by position in the trajectory
        metrics.update(turn_metrics(accelerator.reduce(sum(s["by_turn"] for s in stats), "sum")))
    return metrics


def main(args: Args) -> None:
    accelerator = Accelerator(cpu=args.device == "cpu")
    check(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available")
    check_args(args, accelerator.num_processes)
    # Everything that can be wrong with the input is found before a model is built.
    task = load_task(args.task, args.data_path, args.eval_data_path, args.eval_prompts, args.train_size, args.prompt_column,
                     args.answer_column, args.reward, args.reward_weights, args.eval_fraction, args.extra_eval_data_path)
    check(args.prompts_per_step <= len(task.train),
          f"--prompts-per-step ({args.prompts_per_step}) is more than the {len(task.train)} training prompts")
    check_engine(args, task)
    model_path = resolve_model(args.model, args.task, args.trust_remote_code)
    args.max_new_tokens = args.max_new_tokens or task.max_new_tokens
    checkpoint = find_checkpoint(args.resume, accelerator) if args.resume else None
    if checkpoint is not None:
        check_resume(args, run_dir_of(checkpoint))
    run_name = args.run_name or f"is_grpo__{args.task}__s{args.seed}__{int(time.time())}"
    run_dir = run_dir_of(checkpoint) if checkpoint else Path(args.output_dir) / run_name

    set_seed(args.seed)
    tokenizer = load_tokenizer(model_path, args.trust_remote_code)
    check_chat(task, tokenizer)  # a multi-turn task on a chat template it cannot continue: refused here
    reach = run_reach(task, tokenizer, args.max_new_tokens)  # the longest sequence a run scores: checked that far
    policy = load_policy(model_path, checkpoint, args, reach)  # dtype, LoRA adapters, gradient checkpointing
    if args.pure_dtype:
        print(pure_dtype_warning(policy, args.lr, args.dtype), file=sys.stderr)
    ref = load_reference(model_path, args, policy).to(accelerator.device) if args.beta > 0 else None
    eos_ids = eos_token_ids(policy, tokenizer)
    optimizer = torch.optim.AdamW(trainable(policy), lr=args.lr, weight_decay=args.weight_decay)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    state = load_state(checkpoint, optimizer) if checkpoint else {"step": -1, "extra": {}}
    start = state["step"] + 1
    sigma_hat = state["extra"]["sigma_hat"].numpy() if checkpoint else np.full(len(task.train), np.nan)  # NaN: never drawn
    engine = start_engine(args, model_path, policy, accelerator)  # --engine vllm: holds the policy's weights
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    P = args.prompts_per_step // world  # prompts of this process
    G = args.num_generations
    writer = None
    if accelerator.is_main_process:
        writer = MetricsWriter(run_dir, args, args.track, args.wandb_project, resume_step=start - 1)

    def eval_now() -> dict:
        return evaluate(accelerator.unwrap_model(policy), tokenizer, task, args.eval_samples, args.eval_k,
                        args.max_new_tokens, args.temperature, eos_ids, device, args.seed, rank, world, args.generation_batch_size,
                        args.top_k, args.top_p, args.eval_cache)

    stop = GracefulStop()
    bar = progress_bar(args.steps, initial=max(start - 1, 0), disable=not accelerator.is_main_process, desc=run_dir.name)
    for step in range(start, args.steps + 1):
        if step == 0:  # the base policy: every curve starts here
            metrics = eval_now()
            if writer:
                writer.log(0, metrics)
            continue
        # ---- 1. draw prompts with q(x) proportional to sigma_hat_x (uniformly for the ablation); the draw
        #         depends only on (seed, step) and sigma_hat, so resume and sharding see the same prompts
        t0 = time.perf_counter()
        q = prompt_probs(sigma_hat, args)  # (logged)
        chosen = draw_prompts(sigma_hat, args, step)
        local = list(range(rank * P, (rank + 1) * P))  # positions of this process's prompts in the global batch
        rows = task.train.select(chosen[local].tolist())
        prompts = [p for p in rows["prompt"] for _ in range(G)]
        answers = [a for a in rows["answer"] for _ in range(G)]
        # ---- 2. roll out G completions per prompt, each with its own noise key (seed, step, prompt, g)
        keys = [(args.seed, step, i, g) for i in local for g in range(G)]
        batch = rollout(accelerator.unwrap_model(policy), tokenizer, prompts, keys, args.max_new_tokens,
                        args.temperature, eos_ids, device, task.envs(answers), args.generation_batch_size, args.top_k,
                        args.top_p, engine)  # envs: multi-turn tasks only
        # ---- 3. score, 4. group-relative advantages over the global batch
        parts = {}  # --reward functions' own values, logged as reward/<name>
        scored = task.score(batch, answers, rows, parts)  # (rewards, successes)
        rewards, successes = (accelerator.gather(torch.tensor(x, device=device).float()) for x in scored)
        parts = {f"reward/{k}": accelerator.gather(torch.tensor(v, device=device)).mean().item() for k, v in parts.items()}
        group_std = rewards.view(-1, G).std(dim=1)
        update_sigma(sigma_hat, chosen, group_std.cpu().numpy(), args.sigma_decay)
        advantages = is_advantages(rewards, G, args.prompt_weighting)[rank * P * G : (rank + 1) * P * G]
        rollout_s = time.perf_counter() - t0
        # ---- 5. optimise
        t0 = time.perf_counter()
        metrics = optimise(policy, ref, optimizer, accelerator, batch, advantages, args, step)
        if engine is not None:  # the next batch is sampled by the weights it trains
            metrics["time/engine_push_s"] = engine.push(accelerator.unwrap_model(policy))
        train_s = time.perf_counter() - t0
        # ---- 6. log
        lengths = accelerator.gather(batch.completion_mask.sum(-1).float())
        finished = accelerator.gather(batch.finished.float())
        metrics.update({
            "reward/mean": rewards.mean().item(),
            **parts,
            "reward/std": rewards.std().item(),
            "reward/group_std_mean": group_std.mean().item(),  # within-prompt spread
            "sampling/distinct_prompts": len(set(chosen.tolist())),
            "sampling/q_max_over_uniform": q.max() * len(q),  # 1 when q is uniform
            "sampling/q_cv": q.std() / q.mean(),  # spread of the sampling probabilities
            "sampling/seen_frac": float(np.mean(~np.isnan(sigma_hat))),
            "accuracy/train": successes.mean().item(),
            "frac_reward_zero_std": frac_zero_std(rewards, G),
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_frac": 1.0 - finished.mean().item(),
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "throughput/samples_per_s": len(rewards) / (rollout_s + train_s),
            "throughput/tokens_per_s": lengths.sum().item() / (rollout_s + train_s),
            **device_memory(device),
        })
        if batch.turn_ids is not None:
            metrics.update(trajectory_metrics(accelerator.gather(trajectory_lengths(batch))))
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(eval_now())
        if writer:
            writer.log(step, metrics)
        bar.update(1)
        bar.set_postfix({k: f"{metrics[k]:.2f}" for k in ("reward/mean", "eval/pass@1") if k in metrics})
        # ---- 7. checkpoint (all processes agree on a stop request)
        stopping = accelerator.reduce(torch.tensor(float(stop.requested), device=device), "sum").item() > 0
        if step % args.save_every == 0 or step == args.steps or stopping:
            weights = accelerator.get_state_dict(policy)  # under FSDP gathered from every process's shard
            if accelerator.is_main_process:
                save_checkpoint(run_dir, step, accelerator.unwrap_model(policy), tokenizer, optimizer,
                                extra={"sigma_hat": torch.from_numpy(sigma_hat)}, weights=weights)
            accelerator.wait_for_everyone()
        if stopping:
            bar.close()
            print(f"stopped at step {step}; resume with --resume {run_dir}", file=sys.stderr)
            sys.exit(130)
    bar.close()
    stop.restore()
    if writer:
        writer.close()
        print(f"run: {run_dir}")
        if args.export_dtype:  # a copy in the serving dtype; the checkpoints stay float32
            print(f"export: {export_model(run_dir, accelerator.unwrap_model(policy), tokenizer, args.export_dtype)}")
        print_summary(run_dir, args.steps, args.eval_k)


if __name__ == "__main__":
    run(main, tyro.cli(Args))
