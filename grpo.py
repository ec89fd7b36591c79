"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

For each prompt x, sample a group of G completions y_1..y_G from pi_old, score them with the task
reward R_i, and use the group as the baseline (no critic):

    A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + 1e-4)                     (same A_i for every token)

    J(theta) = E[ agg_{i,t} min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i) - beta * KL_k3(pi_theta || pi_ref) ]

    r_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)

`agg` is --loss-agg (seq-mean-token-mean in the paper; token-mean is DAPO's; seq-mean-token-sum-norm
with --scale-rewards none is Dr. GRPO). --eps-high 0.28 is DAPO's clip-higher. --importance-level sequence is GSPO
(Zheng et al. 2025, arXiv:2507.18071, Qwen3's RL objective): r_it replaced by the length-normalised sequence ratio

    s_i = (pi_theta(y_i | x) / pi_old(y_i | x))^(1/|y_i|) = exp(mean_t log r_it)     (clipped at 3e-4 / 4e-4 by default)

the same for every token of y_i; sequence-token is GSPO-token (s_i's value, each token's own gradient).

Why the clip fraction is zero: with --num-iterations 1 the batch gets one optimiser step, taken at
the weights that sampled it, so pi_theta == pi_old, r == 1 and clipping never binds. It binds from
the second pass over a batch on (--num-iterations 2 or more); the logged policy/ratio_* and
policy/clip_frac_* show it.

Run:
    python grpo.py                                        # the embedded job: offline, under 2 minutes on 2 CPU cores
    python grpo.py --task chain-4-partial                 # multi-turn: 4 model turns, credit per correct turn
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --max-new-tokens 256 --lr 1e-6
    accelerate launch --num_processes 2 grpo.py ...       # prompts sharded, gradients averaged
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
from common.rollout import (concat_rollouts, evaluate, micro_batches, rollout, run_reach, runs_prompts_once,
                            select_rows, token_logprobs)
from common.tasks import load_task


DEFAULT_EPS = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4), "sequence-token": (3e-4, 4e-4)}  # GSPO's for s_i


@dataclass
class Args:
    # ---------------------------------------------------------------- experiment
    seed: int = 0
    """seed of the prompt order, the sampling noise and the model's initial state"""
    run_name: str | None = None
    """name of the run directory under --output-dir (default: grpo__<task>__s<seed>__<unix time>)"""
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
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and draw fresh prompts in their place"""
    max_sampling_rounds: int = 4
    """--dynamic-sampling: at most this many draws per step; places still empty then keep all-equal groups"""
    top_p: float = 1.0
    """sample from the smallest set of most likely tokens whose probability reaches top_p (1: all); scored the same way"""
    top_k: int = 0
    """sample from the top_k most likely tokens only (0: all); scored the same way, so the first-pass ratio stays 1"""
    engine: Literal["hf", "vllm"] = "hf"
    """sampler of the training rollouts: postrl's own, or vLLM in this process (common/engine.py; pip install -e '.[vllm]')"""
    tis_cap: float | None = None
    """correct the sampler/trainer mismatch (mu != pi_old: --engine vllm's kernels) by truncated importance sampling:
    each token's surrogate times min(pi_old / mu, C) (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"); None: no correction"""
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
    importance_level: Literal["token", "sequence", "sequence-token"] = "token"
    """the ratio each token's surrogate clips: token r_it (GRPO); sequence s_i = exp(mean_t log r_it) (GSPO);
    sequence-token s_i's value with each token's gradient (GSPO-token); common.losses.importance_ratio"""
    eps_low: float | None = None
    """lower clip range: ratios below 1 - eps_low are clipped when A < 0 (default 0.2; GSPO's 3e-4 for the sequence
    levels)"""
    eps_high: float | None = None
    """upper clip range: ratios above 1 + eps_high are clipped when A > 0 (default 0.2, DAPO's clip-higher 0.28; GSPO's
    4e-4 for the sequence levels)"""
    beta: float = 0.04
    """KL coefficient against the reference model; 0 loads no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """estimator of KL(pi_theta || pi_ref) per token (k3 in the paper)"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how per-token losses are averaged: GRPO | DAPO | Dr. GRPO (see common/losses.py)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide centred rewards by the group std, the batch std, or nothing (Dr. GRPO)"""
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

    def __post_init__(self):  # the clip range's default depends on the ratio it clips
        low, high = DEFAULT_EPS.get(self.importance_level, DEFAULT_EPS["token"])
        self.eps_low = low if self.eps_low is None else self.eps_low
        self.eps_high = high if self.eps_high is None else self.eps_high


# Flags that may differ between a run and its resumption.
RESUMABLE = {"resume", "export_dtype", "steps", "save_every", "eval_every", "track", "eval_cache", "device", "run_name", "output_dir",
             "extra_eval_data_path", "microbatch_tokens", "generation_batch_size"}


def check_args(args: Args, num_processes: int) -> None:
    check(args.num_generations >= 2, f"--num-generations must be at least 2 (got {args.num_generations}): "
                                     "a group needs two completions to have a baseline")
    check(args.beta >= 0, f"--beta must be >= 0 (got {args.beta})")
    check(0 < args.eps_low < 1, f"--eps-low must be in (0, 1) (got {args.eps_low})")
    check(args.eps_high > 0, f"--eps-high must be > 0 (got {args.eps_high})")
    check(args.lr > 0, f"--lr must be > 0 (got {args.lr})")
    check(args.temperature > 0, f"--temperature must be > 0 (got {args.temperature})")
    check(0 < args.top_p <= 1 and args.top_k >= 0, f"--top-p must be in (0, 1] and --top-k >= 0 (got {args.top_p}, {args.top_k})")
    check(args.steps >= 1, f"--steps must be >= 1 (got {args.steps})")
    check(args.num_iterations >= 1, f"--num-iterations must be >= 1 (got {args.num_iterations})")
    check(args.max_sampling_rounds >= 1, f"--max-sampling-rounds must be >= 1 (got {args.max_sampling_rounds})")
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
    check(args.tis_cap is None or args.tis_cap >= 1, f"--tis-cap must be >= 1 (got {args.tis_cap})")
    check(args.data_path is None or os.path.isfile(args.data_path), f"--data-path {args.data_path}: no such file")
    check(args.eval_data_path is None or os.path.isfile(args.eval_data_path), f"--eval-data-path {args.eval_data_path}: no such file")
    for path in args.extra_eval_data_path:
        check(os.path.isfile(path), f"--extra-eval-data-path {path}: no such file")


def check_resume(args: Args, run_dir: Path) -> None:
    saved, default = json.loads((run_dir / "args.json").read_text()), asdict(Args())  # a flag added since: its default
    for key, value in asdict(args).items():
        check(key in RESUMABLE or saved.get(key, default[key]) == value,
              f"--{key.replace('_', '-')} is {value!r} but the run being resumed used {saved.get(key)!r}")


# ---------------------------------------------------------------- the GRPO objective
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, args: Args, num_seqs, num_tokens, turn_ids=None, max_turns=1,
              behav_logps=None):
    """Clipped surrogate plus beta * KL, per token, aggregated with the whole batch's counts; with
    turn_ids (multi-turn), the clip and ratio statistics per model turn too. With --tis-cap, behav_logps are the
    sampler's log-probs mu."""
    ratio = importance_ratio(logps, old_logps, mask, args.importance_level)  # r_it, or GSPO's s_i; 1 on a first pass
    A = advantages[:, None]
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.eps_low, 1 + args.eps_high) * A)
    if args.tis_cap is not None:  # min(pi_old / mu, C): the sampler's tokens re-weighted towards the trainer's pi_old
        surrogate = torch.clamp(torch.exp(old_logps - behav_logps), max=args.tis_cap) * surrogate
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


def sample_groups(policy, tokenizer, task, accelerator, args: Args, step: int, eos_ids, engine=None):
    """Steps 1-3 for this process's P prompts: draw prompts, roll out G completions each, score them. Step t's
    draws depend only on (seed, t), so resume and sharding see the same prompts and noise.

    With --dynamic-sampling, DAPO's over-sample-and-filter (Yu et al. 2025, Algorithm 1): a group whose G rewards
    are all equal has zero advantages, so it is set aside and fresh prompts are drawn, round after round, until every
    process holds P groups whose rewards differ. Every process takes the same rounds. A round draws prompts not yet
    drawn in this step (all that remain, if fewer than --prompts-per-step do); after --max-sampling-rounds, or when no
    prompt is left, the places still empty take the all-equal groups set aside. Returns the batch, its rewards,
    successes and reward parts, the rounds drawn and the all-equal groups left out (of this process)."""
    rank, world, G = accelerator.process_index, accelerator.num_processes, args.num_generations
    P, total = args.prompts_per_step // world, args.prompts_per_step
    with_signal, all_equal = [], []  # groups: (rollout, its rows, rewards, successes, reward parts)
    used, rounds = np.array([], dtype=int), 0
    while True:
        # ---- draw prompts (round 0: the whole pool, grpo.py's draw; later rounds: those not drawn yet this step)
        rng = np.random.default_rng([args.seed, step] if rounds == 0 else [args.seed, step, rounds])
        pool = np.setdiff1d(np.arange(len(task.train)), used)
        chosen = pool[rng.choice(len(pool), min(total, len(pool)), replace=False)]
        used = np.concatenate([used, chosen])
        local = [i for i in range(rank * P, (rank + 1) * P) if i < len(chosen)]  # this process's places in the draw
        # ---- roll out G completions each, noise keys (seed, step, round * total + prompt, g), and score them
        if local:
            rows = task.train.select(chosen[local].tolist())
            answers = [a for a in rows["answer"] for _ in range(G)]
            keys = [(args.seed, step, rounds * total + i, g) for i in local for g in range(G)]
            batch = rollout(accelerator.unwrap_model(policy), tokenizer, [p for p in rows["prompt"] for _ in range(G)], keys,
                            args.max_new_tokens, args.temperature, eos_ids, accelerator.device, task.envs(answers),
                            args.generation_batch_size, args.top_k, args.top_p, engine)  # envs: multi-turn tasks only
            parts = {}  # --reward functions' own values, logged as reward/<name>
            rewards, successes = task.score(batch, answers, rows, parts)
        rounds += 1
        if not args.dynamic_sampling:  # GRPO: one draw, every group
            return batch, rewards, successes, parts, rounds, 0
        # ---- DAPO's filter: a group trains only if its rewards differ
        for g0 in range(0, len(local) * G, G):
            group = (batch, list(range(g0, g0 + G)), rewards[g0 : g0 + G], successes[g0 : g0 + G],
                     {k: v[g0 : g0 + G] for k, v in parts.items()})
            (all_equal if min(group[2]) == max(group[2]) else with_signal).append(group)
        short = accelerator.reduce(torch.tensor(float(len(with_signal) < P), device=accelerator.device), "sum").item()
        if short == 0 or rounds == args.max_sampling_rounds or len(used) == len(task.train):
            break
    kept = (with_signal + all_equal)[:P]  # places still empty take all-equal groups
    left_out = len(all_equal) - max(P - len(with_signal), 0)
    batch = concat_rollouts([select_rows(b, rows) for b, rows, *_ in kept], tokenizer.pad_token_id)
    rewards, successes = [r for g in kept for r in g[2]], [x for g in kept for x in g[3]]
    return batch, rewards, successes, {k: [x for g in kept for x in g[4][k]] for k in kept[0][4]}, rounds, max(left_out, 0)


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
                                         num_seqs, num_tokens, mb.turn_ids, batch.max_turns, mb.logprobs)
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
    check(not args.dynamic_sampling or args.prompts_per_step < len(task.train),
          f"--dynamic-sampling needs more training prompts than --prompts-per-step ({args.prompts_per_step}): with "
          f"{len(task.train)} no fresh prompt is left to replace a group it drops")
    check_engine(args, task)
    model_path = resolve_model(args.model, args.task, args.trust_remote_code)
    args.max_new_tokens = args.max_new_tokens or task.max_new_tokens
    checkpoint = find_checkpoint(args.resume, accelerator) if args.resume else None
    if checkpoint is not None:
        check_resume(args, run_dir_of(checkpoint))
    run_name = args.run_name or f"grpo__{args.task}__s{args.seed}__{int(time.time())}"
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
        # ---- 1-3. sample prompts, roll out G completions each (noise keys (seed, step, prompt, g)), score
        t0 = time.perf_counter()
        batch, *scored, parts, rounds, dropped = sample_groups(policy, tokenizer, task, accelerator, args, step, eos_ids, engine)
        rewards, successes = (accelerator.gather(torch.tensor(x, device=device).float()) for x in scored)
        parts = {f"reward/{k}": accelerator.gather(torch.tensor(v, device=device)).mean().item() for k, v in parts.items()}
        # ---- 4. group-relative advantages over the global batch
        advantages = group_advantages(rewards, G, args.scale_rewards)[rank * P * G : (rank + 1) * P * G]
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
            "reward/group_std_mean": rewards.view(-1, G).std(dim=1).mean().item(),  # within-prompt spread
            "accuracy/train": successes.mean().item(),
            "frac_reward_zero_std": frac_zero_std(rewards, G),
            **({"sampling/rounds": float(rounds),  # DAPO: draws this step, all-equal groups dropped (all processes)
                "sampling/dropped_groups": accelerator.reduce(torch.tensor(float(dropped), device=device), "sum").item()}
               if args.dynamic_sampling else {}),
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
