"""PPO with a learned critic for language models (Schulman et al. 2017, arXiv:1707.06347), with the
LLM details of "The N+ implementation details of RLHF with PPO" (Huang et al. 2024).

Each completion token y_t is an action; the critic V estimates the return from the state before
it. The reward is per token: a KL penalty to the reference at every token, and the task's score
at the last real token,

    r_t = -beta * (log pi_old(y_t|.) - log pi_ref(y_t|.))  +  [t = last] * score      (k1 in the reward)

(a completion that never emits EOS gets the score --no-eos-penalty instead). Advantages by GAE,

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),    A_t = sum_l (gamma lam)^l delta_{t+l},    R_t = A_t + V(s_t),

whitened over the batch. VC-PPO (Yuan et al. 2025, arXiv:2503.01491) decouples the critic's lam from the actor's:
--critic-lam 1 trains V on Monte-Carlo returns R_t = sum_l gamma^l r_{t+l} (a final reward not decayed along a long
answer) while the advantages keep --lam; and --value-warmup-steps N trains only the critic on the first N batches
(samples of the initial policy, whose weights stay as they are) so that V starts calibrated. Then --ppo-epochs passes
over the batch in --minibatches, each minibatch one optimiser step on

    L = E_t[ max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps)) ]                                   (policy)
      + vf_coef * 0.5 * E_t[ max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) ]              (value)
      - ent_coef * E_t[ entropy ],          r_t = pi_theta(y_t|.) / pi_old(y_t|.),

stopping the epochs early when the approximate KL(pi_old || pi_theta) passes --target-kl (CleanRL).
The first minibatch of the first epoch has r = 1; clipping binds from the second minibatch on.
An adaptive controller (Ziegler et al. 2019) can move beta toward --adaptive-kl-target.

Run:
    python ppo.py                                         # the embedded job, offline
    python ppo.py --critic separate                       # a separate critic model instead of a value head
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --max-new-tokens 256 --lr 1e-6
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from common.checkpoint import GracefulStop, export_model, find_checkpoint, load_state, run_dir_of, save_checkpoint
from common.cli import check, run
from common.engine import check_engine, mismatch_metrics, start_engine
from common.logging import MetricsWriter, device_memory, print_summary, progress_bar
from common.losses import kl_estimate, masked_whiten
from common.models import (eos_token_ids, load_policy, load_reference, load_tokenizer, optimizer_step, pure_dtype_warning,
                           resolve_model, trainable)
from common.rollout import completion_logits, evaluate, logprobs_from_logits, rollout, run_reach, trimmed
from common.tasks import load_task


@dataclass
class Args:
    # ---------------------------------------------------------------- experiment
    seed: int = 0
    """seed of the prompt order, the sampling noise and the model's initial state"""
    run_name: str | None = None
    """name of the run directory under --output-dir (default: ppo__<task>__s<seed>__<unix time>)"""
    output_dir: str = "runs"
    """where runs are written: <output-dir>/<run-name>/{args.json, metrics.jsonl, checkpoints/}"""
    resume: str | None = None
    """resume from a run directory (its latest checkpoint) or a checkpoint directory; other flags must match the run"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: what accelerate picks (a GPU if there is one)"""
    # ---------------------------------------------------------------- model and task
    model: str = "embedded"
    """hub id or local directory; `embedded` is the tiny warm-started model of an embedded --task"""
    critic: Literal["head", "separate"] = "head"
    """value function: a scalar head on the policy's last hidden state, or a separate copy of --model with its own head"""
    task: str = "reverse"
    """reverse | reverse-long | add (embedded, offline) | gsm8k (hub `openai/gsm8k`, or --data-path)"""
    data_path: str | None = None
    """gsm8k: a .json/.jsonl file with `question` and `answer` fields; math: MATH rows; data: any .json/.jsonl/.csv/.parquet"""
    train_size: int | None = None
    """use only the first N training prompts (default: all)"""
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
    steps: int = 150
    """PPO iterations; each samples a fresh batch of prompts (8 optimiser steps each by default)"""
    prompts_per_step: int = 256
    """prompts per step (global, over all processes); one completion each by default"""
    num_generations: int = 1
    """completions per prompt (PPO needs no group; >1 only to match another method's sampling)"""
    max_new_tokens: int | None = None
    """completion budget (default: the task's)"""
    temperature: float = 1.0
    """sampling temperature; the training forward divides logits by it too"""
    top_p: float = 1.0
    """sample from the smallest set of most likely tokens whose probability reaches top_p (1: all); scored the same way"""
    top_k: int = 0
    """sample from the top_k most likely tokens only (0: all); scored the same way, so the first-pass ratio stays 1"""
    engine: Literal["hf", "vllm"] = "hf"
    """sampler of the rollouts: postrl's own, or vLLM in this process (common/engine.py; pip install -e '.[vllm]')"""
    # ---------------------------------------------------------------- algorithm
    lr: float = 1e-4
    """AdamW learning rate for the policy and the critic"""
    ppo_epochs: int = 2
    """passes over each batch (2 since 2026-12-06: at 4, 100 steps ended at held-out 0.790-0.885 over seeds 0-2 on an
    Intel Xeon, its accuracy swinging by 0.05-0.1 between evaluations; repro/README.md, each script with no arguments)"""
    minibatches: int = 4
    """minibatches per pass; each is one optimiser step"""
    cliprange: float = 0.2
    """eps of the clipped policy loss"""
    cliprange_value: float = 0.2
    """c of the clipped value loss: V may move at most c from V_old"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    vf_lr: float | None = None
    """learning rate of the critic (the value head, and a separate critic's weights); default: --lr (verl and OpenRLHF
    give the critic its own, often 10x the actor's)"""
    ent_coef: float = 0.0
    """weight of the entropy bonus"""
    gamma: float = 1.0
    """discount over completion tokens"""
    lam: float = 0.95
    """GAE lambda of the actor's advantages (and of the critic's returns, unless --critic-lam)"""
    critic_lam: float | None = None
    """GAE lambda of the critic's returns (VC-PPO's decoupled GAE: 1.0, Monte-Carlo returns); default: --lam"""
    value_warmup_steps: int = 0
    """the first N batches train the critic only, the policy's weights untouched (VC-PPO's value pretraining)"""
    kl_coef: float = 0.05
    """beta: KL penalty to the reference in the per-token reward (0 loads no reference model)"""
    adaptive_kl_target: float | None = None
    """if set, an adaptive controller moves beta so that the KL to the reference (per completion) approaches this"""
    adaptive_kl_horizon: int = 10000
    """horizon (in completions) of the adaptive KL controller"""
    target_kl: float | None = None
    """stop the epochs of a step early when approx KL(pi_old || pi_theta) exceeds this (CleanRL); None: never"""
    no_eos_penalty: float | None = -1.0
    """score given to a completion that never emits EOS (None: keep the task's score)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards over the batch before GAE"""
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
             "extra_eval_data_path", "generation_batch_size"}


def check_args(args: Args, num_processes: int) -> None:
    check(args.num_generations >= 1, f"--num-generations must be >= 1 (got {args.num_generations})")
    check(args.kl_coef >= 0, f"--kl-coef must be >= 0 (got {args.kl_coef})")
    check(0 < args.cliprange < 1, f"--cliprange must be in (0, 1) (got {args.cliprange})")
    check(args.cliprange_value > 0, f"--cliprange-value must be > 0 (got {args.cliprange_value})")
    check(0 <= args.gamma <= 1 and 0 <= args.lam <= 1, f"--gamma and --lam must be in [0, 1] (got {args.gamma}, {args.lam})")
    check(args.critic_lam is None or 0 <= args.critic_lam <= 1, f"--critic-lam must be in [0, 1] (got {args.critic_lam})")
    check(0 <= args.value_warmup_steps < args.steps,
          f"--value-warmup-steps must be in [0, --steps) (got {args.value_warmup_steps}, --steps {args.steps})")
    check(args.lr > 0 and (args.vf_lr is None or args.vf_lr > 0), f"--lr and --vf-lr must be > 0 (got {args.lr}, {args.vf_lr})")
    check(args.temperature > 0, f"--temperature must be > 0 (got {args.temperature})")
    check(0 < args.top_p <= 1 and args.top_k >= 0, f"--top-p must be in (0, 1] and --top-k >= 0 (got {args.top_p}, {args.top_k})")
    check(args.steps >= 1 and args.ppo_epochs >= 1, f"--steps and --ppo-epochs must be >= 1 (got {args.steps}, {args.ppo_epochs})")
    check(args.max_new_tokens is None or args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    check(args.prompts_per_step >= 1 and args.prompts_per_step % num_processes == 0,
          f"--prompts-per-step ({args.prompts_per_step}) must be a positive multiple of the number of processes ({num_processes})")
    local_rows = args.prompts_per_step // num_processes * args.num_generations
    check(1 <= args.minibatches <= local_rows,
          f"--minibatches must be in [1, {local_rows}] (the completions per process per step), got {args.minibatches}")
    check(args.adaptive_kl_target is None or (args.adaptive_kl_target > 0 and args.kl_coef > 0),
          "--adaptive-kl-target needs a positive target and --kl-coef > 0")
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


# ---------------------------------------------------------------- the actor and the critic
class ActorCritic(nn.Module):
    """The policy, and a value V(s_t) for the state before each completion token: a linear head on
    the policy's last hidden state, or on a separate critic model's."""

    def __init__(self, policy, critic=None):
        super().__init__()
        self.policy, self.critic = policy, critic
        hidden = (critic or policy).config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.value_head.weight, std=1e-3)  # initialised small: V starts near 0
        nn.init.zeros_(self.value_head.bias)

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        inputs = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        logits, hidden = completion_logits(self.policy, *inputs, with_hidden=self.critic is None)
        if self.critic is not None:
            _, hidden = completion_logits(self.critic, *inputs, with_hidden=True, logits=False)  # no vocabulary logits
        return logits, self.value_head(hidden.float()).squeeze(-1)


# ---------------------------------------------------------------- rewards and advantages
def per_token_rewards(scores, logps, ref_logps, mask, kl_coef: float):
    """r_t = -beta * (log pi_old - log pi_ref) at every completion token, plus the score at the last real token."""
    rewards = -kl_coef * (logps - ref_logps) * mask if ref_logps is not None else torch.zeros_like(logps)
    last = mask.sum(-1).long() - 1  # index of the last real token (EOS, or the last one when truncated)
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over completion tokens; the state after the last real token
    is terminal (V = 0). Returns advantages and returns = advantages + values, 0 where masked."""
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_mask = mask[:, t + 1] if t + 1 < T else torch.zeros_like(mask[:, 0])
        next_value = values[:, t + 1] * next_mask if t + 1 < T else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_mask * next_advantage
        advantages[:, t] = next_advantage
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def advantages_and_returns(task_scores, finished, old_logps, ref_logps, old_values, mask, kl_coef: float, args: Args,
                           reduce=None):
    """The score (--no-eos-penalty for a completion that never ended), the per-token rewards (whitened with
    --whiten-rewards, their mean kept), GAE, and the advantages whitened; whitening over the global batch (reduce sums
    over processes), so N processes take one process's step. The returns (the critic's targets) are GAE's at
    --critic-lam where it is set (VC-PPO), at --lam else."""
    scores = task_scores
    if args.no_eos_penalty is not None:
        scores = torch.where(finished, task_scores, torch.full_like(task_scores, args.no_eos_penalty))
    rewards = per_token_rewards(scores, old_logps, ref_logps, mask, kl_coef)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False, reduce=reduce) * mask
    advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
    if args.critic_lam is not None and args.critic_lam != args.lam:  # VC-PPO's decoupled GAE: the critic's own lam
        _, returns = gae(rewards, old_values, mask, args.gamma, args.critic_lam)
    return masked_whiten(advantages, mask, reduce=reduce) * mask, returns


def explained_variance(values, returns, mask, reduce=None) -> float:
    """1 - Var(R - V) / Var(R) over the valid tokens of the global batch (reduce sums over processes): 1 is a perfect
    critic, 0 no better than a constant."""
    reduce = reduce or (lambda t: t)
    mask = mask.float()

    def mean(x):
        return reduce((x * mask).sum()) / reduce(mask.sum()).clamp(min=1)

    var_returns = mean((returns - mean(returns)) ** 2)
    residual = returns - values
    var_residual = mean((residual - mean(residual)) ** 2)
    return (1 - var_residual / var_returns).item() if var_returns > 0 else float("nan")


# ---------------------------------------------------------------- the PPO objective
def ppo_loss(logps, old_logps, values, old_values, advantages, returns, entropy, mask, args: Args, num_tokens,
             warmup: bool = False):
    """Clipped policy loss + vf_coef * clipped value loss - ent_coef * entropy, token means over the
    whole minibatch (num_tokens counts its tokens on every process); during the value warm-up the value loss alone."""
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    pg_losses = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - args.cliprange, 1 + args.cliprange))
    values_clipped = old_values + torch.clamp(values - old_values, -args.cliprange_value, args.cliprange_value)
    vf_losses = 0.5 * torch.max((values - returns) ** 2, (values_clipped - returns) ** 2)
    pg_loss = (pg_losses * mask).sum() / num_tokens
    vf_loss = (vf_losses * mask).sum() / num_tokens
    entropy_mean = (entropy * mask).sum() / num_tokens
    policy_terms = pg_loss - args.ent_coef * entropy_mean
    # during the warm-up the value loss alone; the policy's terms at weight 0 keep every parameter in the graph (DDP
    # reduces every gradient), and the policy's gradients are dropped before the step (optimise)
    loss = args.vf_coef * vf_loss + (0.0 * policy_terms if warmup else policy_terms)
    with torch.no_grad():
        m = mask.bool()
        stats = {
            "pg_loss": pg_loss, "vf_loss": vf_loss, "entropy": entropy_mean,
            "ratio": ratio[m].sum(), "ratio_min": ratio[m].min(), "ratio_max": ratio[m].max(),
            "clip_low": ((ratio < 1 - args.cliprange) & (advantages < 0))[m].sum(),
            "clip_high": ((ratio > 1 + args.cliprange) & (advantages > 0))[m].sum(),
            "vf_clip": ((values - old_values).abs() > args.cliprange_value)[m].sum(),
            "approx_kl": kl_estimate(old_logps, logps, "k3")[m].sum(),  # KL(pi_old || pi_theta): (r - 1) - log r
            "tokens": m.sum(),
        }
    return loss, stats


def optimise(model, optimizer, accelerator, batch, old_logps, old_values, advantages, returns, args: Args, step: int):
    """ppo_epochs passes over the batch in shuffled minibatches, one optimiser step each; the
    epochs stop early when the approximate KL of the last epoch exceeds --target-kl."""
    mask = batch.completion_mask
    stats, grad_norms = [], []
    warmup = step <= args.value_warmup_steps  # VC-PPO's value pretraining: the critic alone learns
    for epoch in range(args.ppo_epochs):
        order = torch.from_numpy(np.random.default_rng([args.seed, step, epoch]).permutation(mask.shape[0]))
        epoch_kl, epoch_tokens = 0.0, 0.0
        for rows in order.tensor_split(args.minibatches):
            mb = trimmed(batch, rows)  # no column of padding alone
            T = mb.completion_mask.shape[1]
            num_tokens = accelerator.reduce(mb.completion_mask.sum().float(), "sum") / accelerator.num_processes
            logits, values = model(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask)
            logps, entropy = logprobs_from_logits(logits, mb.completion_ids, args.temperature, True, True, args.top_k, args.top_p)
            loss, minibatch_stats = ppo_loss(logps, old_logps[rows, :T], values, old_values[rows, :T], advantages[rows, :T],
                                             returns[rows, :T], entropy, mb.completion_mask, args, num_tokens, warmup)
            accelerator.backward(loss)  # DDP averages over processes; num_tokens is the per-process share
            if warmup:  # the value loss's gradient through a shared body stops there: the policy's weights stay
                for p in accelerator.unwrap_model(model).policy.parameters():
                    p.grad = None
            grad_norms.append(optimizer_step(optimizer, accelerator, model, args.max_grad_norm, loss, step))
            stats.append(minibatch_stats)
            epoch_kl, epoch_tokens = epoch_kl + minibatch_stats["approx_kl"], epoch_tokens + minibatch_stats["tokens"]
        epoch_kl = accelerator.reduce(torch.as_tensor(epoch_kl, dtype=torch.float32), "sum").item()
        epoch_tokens = accelerator.reduce(torch.as_tensor(epoch_tokens, dtype=torch.float32), "sum").item()
        if args.target_kl is not None and epoch_kl / epoch_tokens > args.target_kl:
            break

    def total(key) -> float:  # summed over minibatches, epochs and processes
        return accelerator.reduce(torch.as_tensor(sum(s[key] for s in stats), dtype=torch.float32), "sum").item()

    def extreme(key: str, fn) -> float:
        return fn(accelerator.gather(fn(torch.stack([s[key] for s in stats])).reshape(1))).item()

    tokens = total("tokens")
    n = len(stats) * accelerator.num_processes
    return {
        "loss/policy": total("pg_loss") / n,
        "value/loss": total("vf_loss") / n,
        "value/clip_frac": total("vf_clip") / tokens,
        "policy/entropy": total("entropy") / n,
        "policy/ratio_mean": total("ratio") / tokens,
        "policy/ratio_min": extreme("ratio_min", torch.min),
        "policy/ratio_max": extreme("ratio_max", torch.max),
        "policy/clip_frac_low": total("clip_low") / tokens,
        "policy/clip_frac_high": total("clip_high") / tokens,
        "policy/approx_kl": total("approx_kl") / tokens,
        "policy/grad_norm": torch.stack(grad_norms).mean().item(),
        "policy/epochs": len(stats) / args.minibatches,
        "value/warmup": float(warmup),
    }


def main(args: Args) -> None:
    accelerator = Accelerator(cpu=args.device == "cpu")
    check(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available")
    check_args(args, accelerator.num_processes)
    # Everything that can be wrong with the input is found before a model is built.
    task = load_task(args.task, args.data_path, args.eval_data_path, args.eval_prompts, args.train_size, args.prompt_column,
                     args.answer_column, args.reward, args.reward_weights, args.eval_fraction, args.extra_eval_data_path)
    check(task.env is None, f"--task {args.task} is multi-turn: ppo.py trains on single completions (its critic and GAE "
                            "would have to skip the environment's tokens); use grpo.py, gapo.py, is_grpo.py or async_grpo.py")
    check(args.prompts_per_step <= len(task.train),
          f"--prompts-per-step ({args.prompts_per_step}) is more than the {len(task.train)} training prompts")
    check_engine(args, task)
    model_path = resolve_model(args.model, args.task, args.trust_remote_code)
    args.max_new_tokens = args.max_new_tokens or task.max_new_tokens
    checkpoint = find_checkpoint(args.resume, accelerator) if args.resume else None
    if checkpoint is not None:
        check_resume(args, run_dir_of(checkpoint))
    run_name = args.run_name or f"ppo__{args.task}__s{args.seed}__{int(time.time())}"
    run_dir = run_dir_of(checkpoint) if checkpoint else Path(args.output_dir) / run_name

    set_seed(args.seed)
    tokenizer = load_tokenizer(model_path, args.trust_remote_code)
    reach = run_reach(task, tokenizer, args.max_new_tokens)  # the longest sequence a run scores: checked that far
    policy = load_policy(model_path, checkpoint, args, reach)  # dtype, LoRA adapters, gradient checkpointing
    if args.pure_dtype:
        print(pure_dtype_warning(policy, args.lr, args.dtype), file=sys.stderr)
    critic = load_policy(model_path, None, args, reach) if args.critic == "separate" else None
    model = ActorCritic(policy, critic)
    ref = load_reference(model_path, args, policy).to(accelerator.device) if args.kl_coef > 0 else None
    eos_ids = eos_token_ids(policy, tokenizer)
    critic_params = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("policy.")]
    optimizer = torch.optim.AdamW([{"params": trainable(policy)}, {"params": critic_params, "lr": args.vf_lr or args.lr}],
                                  lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = load_state(checkpoint, optimizer) if checkpoint else {"step": -1, "extra": {}}
    if checkpoint:  # the critic is not part of the policy's save_pretrained directory: it is in state.pt
        accelerator.unwrap_model(model).value_head.load_state_dict(state["extra"]["value_head"])
        if critic is not None:
            critic.load_state_dict(state["extra"]["critic"])
    start, kl_coef = state["step"] + 1, state["extra"].get("kl_coef", args.kl_coef)
    engine = start_engine(args, model_path, accelerator.unwrap_model(model).policy, accelerator)  # --engine vllm
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    P = args.prompts_per_step // world  # prompts of this process
    G = args.num_generations
    writer = None
    if accelerator.is_main_process:
        writer = MetricsWriter(run_dir, args, args.track, args.wandb_project, resume_step=start - 1)

    def eval_now() -> dict:
        return evaluate(accelerator.unwrap_model(model).policy, tokenizer, task, args.eval_samples, args.eval_k,
                        args.max_new_tokens, args.temperature, eos_ids, device, args.seed, rank, world, args.generation_batch_size,
                        args.top_k, args.top_p, args.eval_cache)

    def save(step: int) -> None:
        weights = accelerator.get_state_dict(model)  # under FSDP gathered from every process's shard
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            part = {name: {k[len(name) + 1 :]: v for k, v in weights.items() if k.startswith(name + ".")}
                    for name in ("policy", "value_head", "critic")}
            extra = {"kl_coef": kl_coef, "value_head": part["value_head"], "critic": part["critic"] or None}
            save_checkpoint(run_dir, step, unwrapped.policy, tokenizer, optimizer, extra=extra, weights=part["policy"])
        accelerator.wait_for_everyone()

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
        # ---- 2. roll out, each completion with its own noise key (seed, step, prompt, g)
        keys = [(args.seed, step, i, g) for i in local for g in range(G)]
        batch = rollout(accelerator.unwrap_model(model).policy, tokenizer, prompts, keys, args.max_new_tokens,
                        args.temperature, eos_ids, device, None, args.generation_batch_size, args.top_k, args.top_p, engine)
        mask = batch.completion_mask.float()
        # ---- 3. score; a completion that never ends gets the penalty score
        parts = {}  # --reward functions' own values, logged as reward/<name>
        task_scores = torch.tensor(task.score(batch, answers, rows, parts)[0], device=device)
        parts = {f"reward/{k}": accelerator.gather(torch.tensor(v, device=device)).mean().item() for k, v in parts.items()}
        # ---- 4. pi_old, V_old and pi_ref at the sampling weights; per-token rewards; GAE
        with torch.no_grad():
            logits, old_values = model(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
            old_logps, _ = logprobs_from_logits(logits, batch.completion_ids, args.temperature, top_k=args.top_k, top_p=args.top_p)
            ref_logps = None
            if ref is not None:
                ref_logits, _ = completion_logits(ref, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                                  batch.completion_mask)
                ref_logps, _ = logprobs_from_logits(ref_logits, batch.completion_ids, args.temperature, top_k=args.top_k,
                                                    top_p=args.top_p)  # the same truncation as pi_old's
            old_values = old_values * mask
            advantages, returns = advantages_and_returns(task_scores, batch.finished, old_logps, ref_logps, old_values,
                                                         mask, kl_coef, args, lambda t: accelerator.reduce(t, "sum"))
        rollout_s = time.perf_counter() - t0
        # ---- 5. optimise
        t0 = time.perf_counter()
        metrics = optimise(model, optimizer, accelerator, batch, old_logps, old_values, advantages, returns, args, step)
        if engine is not None:  # the sampler's log-probs against the trainer's; then the new weights go in
            metrics.update(mismatch_metrics(old_logps[mask.bool()], batch.logprobs[mask.bool()]))
            metrics["time/engine_push_s"] = engine.push(accelerator.unwrap_model(model).policy)
        train_s = time.perf_counter() - t0
        kl_coef_used = kl_coef
        # ---- 6. adapt beta toward the KL target (Ziegler et al.: proportional control, error clipped to +-0.2)
        kl_per_completion = ((old_logps - ref_logps) * mask).sum(-1) if ref is not None else torch.zeros_like(task_scores)
        kl_ref = accelerator.gather(kl_per_completion).mean().item()
        if args.adaptive_kl_target is not None and step > args.value_warmup_steps:  # (the policy is pi_ref till then)
            error = float(np.clip(kl_ref / args.adaptive_kl_target - 1, -0.2, 0.2))
            kl_coef *= 1 + error * args.prompts_per_step * G / args.adaptive_kl_horizon
        # ---- 7. log
        gathered_scores = accelerator.gather(task_scores)
        lengths = accelerator.gather(batch.completion_mask.sum(-1).float())
        finished = accelerator.gather(batch.finished.float())
        non_score = accelerator.gather(-kl_coef_used * kl_per_completion)  # the KL part of each completion's return
        metrics.update({
            "reward/mean": gathered_scores.mean().item(),
            **parts,
            "reward/std": gathered_scores.std().item(),
            "accuracy/train": (gathered_scores >= 1.0).float().mean().item(),
            "objective/kl_ref": kl_ref,
            "objective/kl_coef": kl_coef,
            "objective/non_score_reward": non_score.mean().item(),
            "policy/kl_ref": kl_ref,
            "value/explained_variance": explained_variance(old_values, returns, mask, lambda t: accelerator.reduce(t, "sum")),
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_frac": 1.0 - finished.mean().item(),
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "throughput/samples_per_s": len(gathered_scores) / (rollout_s + train_s),
            "throughput/tokens_per_s": lengths.sum().item() / (rollout_s + train_s),
            **device_memory(device),
        })
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(eval_now())
        if writer:
            writer.log(step, metrics)
        bar.update(1)
        bar.set_postfix({k: f"{metrics[k]:.2f}" for k in ("reward/mean", "eval/pass@1") if k in metrics})
        # ---- 8. checkpoint (all processes agree on a stop request)
        stopping = accelerator.reduce(torch.tensor(float(stop.requested), device=device), "sum").item() > 0
        if step % args.save_every == 0 or step == args.steps or stopping:
            save(step)
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
            print(f"export: {export_model(run_dir, accelerator.unwrap_model(model).policy, tokenizer, args.export_dtype)}")
        print_summary(run_dir, args.steps, args.eval_k)


if __name__ == "__main__":
    run(main, tyro.cli(Args))
