"""GAPO: GRPO with group-adaptive clipping (Jia et al. 2026, arXiv:2609.00444).

Rollouts with a larger learning signal get more room to move up. Rewards are binary and advantages
are not divided by the group std: with c correct completions out of k = G,

    A_i = R_i - mean(R_1..R_k)                     (a correct completion has A = (k - c) / k)

    eps_high(c) = eps_low + (eps_high_max - eps_low) * (k - c) / (k - 1)     for A_i > 0, c in [1, k]
    eps_high    = eps_low                                                  for A_i <= 0

    J(theta) = E[ agg_{i,t} min(s A_i, clip(s, 1 - eps_low, 1 + eps_high(c_i)) A_i) - beta * KL_k3(pi_theta || pi_ref) ]

so a lone correct answer (c = 1) may move up by eps_high_max and an all-correct group by eps_low.
Only the clip bound changes. s is the ratio, at one of two levels (--ratio-level):
  sequence (the paper's main form, GSPO style): s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|),
           the same for every token of y_i; defaults (eps_low, eps_high_max) = (3e-3, 5e-3);
  token:   s_it = pi_theta(y_it|.) / pi_old(y_it|.); defaults (0.2, 0.28).
The default here is the token form: on the tiny embedded model one optimiser step moves the
sequence ratio far more than 0.5 %, so the sequence form clips most of the second pass (measured,
default flags, 200 steps: eval pass@1 0.74 with --ratio-level sequence, 0.87 with token).
Non-binary rewards in [0, 1] (a generalisation, not in the paper): the learning signal
(k - c) / (k - 1) = A_i k / (k - 1) for binary rewards, so eps_high_i uses clamp(A_i k / (k - 1), 0, 1).

As in grpo.py, with --num-iterations 1 the ratio is 1 and no clip binds; the adaptive bound acts
from the second pass over a batch on, hence the default of 2 passes here. clip/frac_c{c} logs the
clip fraction by c.

Run:
    python gapo.py                                        # the embedded job, offline
    python gapo.py --task reverse-long                    # a hard task (base pass@1 of a few %)
    python gapo.py --ratio-level sequence                 # the paper's main form, (3e-3, 5e-3)
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
from common.losses import aggregate, frac_zero_std, group_advantages, importance_ratio, kl_estimate
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
    """name of the run directory under --output-dir (default: gapo__<task>__s<seed>__<unix time>)"""
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
    num_iterations: int = 2
    """optimisation passes over each batch, pi_old fixed; 2 by default so that the adaptive bound acts"""
    minibatches: int = 1
    """micro-batches per pass, each of whole groups (gradient accumulation; one optimiser step per pass, the same update)"""
    microbatch_tokens: int | None = None
    """or micro-batches by a token budget (verl's ppo_max_token_len_per_gpu): groups of like lengths, each micro-batch
    within this many tokens (its prompts once, its completions padded to its longest); the same update, less memory"""
    ratio_level: Literal["sequence", "token"] = "token"
    """token: per-token ratio; sequence: length-normalised sequence ratio (the paper's main form)"""
    eps_low: float | None = None
    """lower clip range, and the upper one of completions with A <= 0 (default: 3e-3 sequence, 0.2 token)"""
    eps_high_max: float | None = None
    """upper clip range of a lone correct completion (c = 1) (default: 5e-3 sequence, 0.28 token)"""
    beta: float = 0.0
    """KL coefficient against the reference model; 0 (the default here) loads no reference model. Without the std
    division GAPO's steps are smaller than GRPO's, and on the embedded job beta 0.04 held it near 0.8 (seeds 0-2 ended
    at 0.786-0.856; repro/README.md, each script with no arguments)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """estimator of KL(pi_theta || pi_ref) per token (k3 in the paper)"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how per-token losses are averaged: GRPO | DAPO | Dr. GRPO (see common/losses.py)"""
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
    check(args.eps_high_max >= args.eps_low, f"--eps-high-max must be >= --eps-low (got {args.eps_high_max} < {args.eps_low})")
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


# ---------------------------------------------------------------- the GAPO objective
DEFAULT_EPS = {"sequence": (3e-3, 5e-3), "token": (0.2, 0.28)}


def adaptive_eps_high(advantages, group_size: int, eps_low: float, eps_high_max: float):
    """eps_high of each completion: eps_low + (eps_high_max - eps_low) * (k - c) / (k - 1) if A > 0,
    else eps_low. With binary rewards (k - c) / (k - 1) = A k / (k - 1); that form, clamped to
    [0, 1], also serves rewards in [0, 1]."""
    signal = (advantages * group_size / (group_size - 1)).clamp(0, 1)
    return eps_low + (eps_high_max - eps_low) * signal


def correct_per_group(successes, group_size: int):
    """c of each completion's group: how many of its G completions succeeded (reward 1 on a single-turn task)."""
    c = (successes >= 1.0).view(-1, group_size).sum(dim=1)
    return c.repeat_interleave(group_size)


def gapo_loss(logps, old_logps, ref_logps, advantages, eps_high, c, mask, args: Args, num_seqs, num_tokens,
              turn_ids=None, max_turns=1):
    """Clipped surrogate with a per-completion upper bound, plus beta * KL, aggregated with the whole batch's
    counts; with turn_ids (multi-turn), the clip and ratio statistics per model turn too."""
    # r_it, or at --ratio-level sequence s_i = exp(mean_t log r_it) for every token of y_i; == 1 on a batch's first pass
    ratio = importance_ratio(logps, old_logps, mask, args.ratio_level)
    A, upper = advantages[:, None], 1 + eps_high[:, None]
    surrogate = torch.min(ratio * A, torch.minimum(ratio.clamp(min=1 - args.eps_low), upper) * A)
    per_token = -surrogate
    if ref_logps is not None:
        per_token = per_token + args.beta * kl_estimate(logps, ref_logps, args.kl_estimator)
    loss = aggregate(per_token, mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)
    with torch.no_grad():  # token sums of the diagnostics; divided by the token count after the step
        m = mask.bool()
        clip_low, clip_high = (ratio < 1 - args.eps_low) & (A < 0), (ratio > upper) & (A > 0)
        group_of_c = torch.nn.functional.one_hot(c, args.num_generations + 1).float().T  # (k + 1, B)
        stats = {
            "ratio": ratio[m].sum(),
            "clip_low": clip_low[m].sum(),  # the clip binds from below
            "clip_high": clip_high[m].sum(),  # the clip binds from above (at the adaptive bound)
            "approx_kl": kl_estimate(old_logps, logps, "k3")[m].sum(),  # KL(pi_old || pi_theta): (r - 1) - log r
            "ratio_min": ratio[m].min(), "ratio_max": ratio[m].max(),
            # token sums by c, the number of correct completions in the group (c = 0..k)
            "tokens_by_c": group_of_c @ mask.sum(-1).float(),
            "clip_by_c": group_of_c @ ((clip_low | clip_high) & m).sum(-1).float(),
            "deviation_by_c": group_of_c @ ((ratio - 1).abs() * mask).sum(-1),
        }
        if turn_ids is not None:
            stats["by_turn"] = turn_stats(ratio, clip_low | clip_high, turn_ids, max_turns)
    return loss, stats


def optimise(policy, ref, optimizer, accelerator, batch, advantages, eps_high, c, args: Args, step: int) -> dict[str, float]:
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
            loss, step_stats = gapo_loss(logps, old_logps[j], ref_logps[j], advantages[mb.rows], eps_high[mb.rows],
                                         c[mb.rows], mb.completion_mask, args, num_seqs, num_tokens, mb.turn_ids,
                                         batch.max_turns)
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
    by_c = {key: accelerator.reduce(sum(s[key] for s in stats), "sum") for key in ("tokens_by_c", "clip_by_c", "deviation_by_c")}
    for c_value, tokens in enumerate(by_c["tokens_by_c"].tolist()):
        if tokens > 0:  # only the values of c that occurred in this batch
            metrics[f"clip/frac_c{c_value}"] = by_c["clip_by_c"][c_value].item() / tokens
            metrics[f"clip/ratio_dev_c{c_value}"] = by_c["deviation_by_c"][c_value].item() / tokens
    if batch.turn_ids is not None:  # multi-turn: clipping by position in the trajectory
        metrics.update(turn_metrics(accelerator.reduce(sum(s["by_turn"] for s in stats), "sum")))
    return metrics


def main(args: Args) -> None:
    accelerator = Accelerator(cpu=args.device == "cpu")
    default_low, default_high = DEFAULT_EPS[args.ratio_level]
    args.eps_low = default_low if args.eps_low is None else args.eps_low
    args.eps_high_max = default_high if args.eps_high_max is None else args.eps_high_max
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
    run_name = args.run_name or f"gapo__{args.task}__s{args.seed}__{int(time.time())}"
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
    start = load_state(checkpoint, optimizer)["step"] + 1 if checkpoint else 0
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
        # ---- 1. sample prompts: step t's prompts depend only on (seed, t), so resume and sharding see the same ones
        t0 = time.perf_counter()
        chosen = np.random.default_rng([args.seed, step]).choice(len(task.train), args.prompts_per_step, replace=False)
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
        mine = slice(rank * P * G, (rank + 1) * P * G)
        advantages = group_advantages(rewards, G, "none")  # centred, not divided by the std
        eps_high = adaptive_eps_high(advantages, G, args.eps_low, args.eps_high_max)
        advantages, eps_high, c = advantages[mine], eps_high[mine], correct_per_group(successes, G)[mine]
        rollout_s = time.perf_counter() - t0
        # ---- 5. optimise
        t0 = time.perf_counter()
        metrics = optimise(policy, ref, optimizer, accelerator, batch, advantages, eps_high, c, args, step)
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
            "reward/group_std_mean": rewards.view(-1, G).std(dim=1).mean().item(),  # within-prompt spread
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
                save_checkpoint(run_dir, step, accelerator.unwrap_model(policy), tokenizer, optimizer, weights=weights)
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
