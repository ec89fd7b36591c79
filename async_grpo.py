"""Asynchronous GRPO: a generation thread samples with lagged weights while the learner trains.

The generator keeps its own copy of the policy. It samples whole steps' batches of groups (GRPO's
prompts and noise keys for that step), tags each with the policy VERSION that made it (the number
of learner steps behind its weights) and the behaviour log-probs log mu, and puts them in a
bounded queue. The learner trains on the next batch and publishes its weights every --sync-every
steps. A batch trained at learner step t (learner version t - 1) has

    staleness = (t - 1) - version                       (0 is grpo.py: sampled by the weights it trains)

--max-staleness K paces the generator: it waits rather than start a batch whose staleness could
exceed K (nothing is dropped; dropping favours fast, short rollouts). --drop-stale instead lets it
run free and the learner drops batches older than K. --mode emulated is the reproducible
experiment: no thread; batch t is sampled from exactly version max(t - 1 - K, 0), so
--max-staleness 0 --mode emulated is grpo.py, bit for bit.

The objective is GRPO's with an off-policy correction (--correction). mu = behaviour policy (the
sampler's weights), pi_old = the learner's weights before this update (recomputed by the learner),
A_i the group-relative advantage, u = pi_theta / pi_old, r = pi_theta / mu, w = pi_old / mu:

    none       min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)            the "bypass": ratio to mu
    tis        min(w, C) * min(u A, clip(u, 1 - eps_low, 1 + eps_high) A)        truncated IS, C = --tis-cap
    decoupled  w * min(u A, clip(u, ...) A), and 0 where w > --decoupled-cap  (AReaL, arXiv:2505.24298)
    m2po       M * r A, no clip: M drops the tokens with the largest (log pi_theta / mu)^2 until the
               mean of the rest is <= --m2po-threshold, recomputed before every pass (M2PO, Zheng et al.
               2025, arXiv:2510.01161; on the first pass pi_theta = pi_old)
    icepop     M(w) * min(u A, clip(u) A), M(w) = w on [a, b], 0 outside: a token whose weight left the band
               drops (IcePop, the Ring-1T report, Ling team 2025; a, b = --icepop-low/-high, 0.5 and 5 as published)
    seq-mask   min(u A, clip(u) A), unweighted, and a whole sequence dropped where its geometric-mean weight
               exp(mean_t log w_t) leaves [1/C, C], C = --seq-mask-cap (verl's geometric rejection, 1.001,
               sized for the sampler/trainer mismatch; TRL's sequence mask caps the product exp(sum_t log w_t))
    opsm       as none, and a whole sequence with A < 0 dropped where mean_t log(mu / pi_theta) > delta
               (off-policy sequence masking, the DeepSeek-V3.2 report, 2025; delta = --opsm-delta; recomputed
               each pass, so from the second pass a sequence the first pushed down is dropped too)
    cispo      sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) A log pi_theta: the weight capped, no token's
               gradient dropped, summed over all tokens / their count whatever --loss-agg says (CISPO, MiniMax-M1,
               arXiv:2506.13585: its 1 / sum_i |o_i|; --cispo-eps-low/-high)
    seq-tis    min(W, C) * min(u A, clip(u) A), W = exp(sum_t log w_t) the sequence's weight (a product over its
               tokens, not their geometric mean), C = --seq-cap (verl's seq_is; TRL's sequence truncate)
    seq-mis    min(u A, clip(u) A), unweighted, a whole sequence dropped where W leaves [1/C, C] (verl's seq_mis, its
               lower bound 1/C by default; TRL's sequence mask)
    vcpo       min(W, C') * u A, no clip, with A from the off-policy optimal baseline and the step's learning rate
               scaled by sqrt(ESS / B) of the sequence weights (VCPO, Huang et al. 2026, arXiv:2602.17616:
               vcpo_advantages; C' = --vcpo-cap, 8 as its public recipe)

minus beta * KL_k3(pi_theta || pi_ref), aggregated by --loss-agg over all completion tokens: a token
that m2po masks, or decoupled, icepop, seq-mask or opsm drops, contributes 0 and still counts in the denominator (the
paper's 1 / sum_i |o_i|; AReaL's cap does the same), so dropping tokens never up-weights the rest,
and a batch with every token masked gives a zero surrogate, not 0 / 0. tis truncates the weight,
decoupled drops the token: the two differ exactly where w > C. On a batch of staleness 0 mu is pi_old.

Run:
    python async_grpo.py                                          # threaded, K = 1, the embedded job
    python async_grpo.py --mode emulated --max-staleness 4 --correction decoupled
"""

from __future__ import annotations

import copy
import json
import math
import os
import queue
import sys
import threading
import time
from collections import deque
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
from common.cli import ConfigError, check, run
from common.engine import check_engine, mismatch, start_engine
from common.logging import MetricsWriter, device_memory, print_summary, progress_bar, read_metrics
from common.losses import aggregate, frac_zero_std, group_advantages, kl_estimate
from common.models import (eos_token_ids, load_policy, load_reference, load_tokenizer, optimizer_step, pure_dtype_warning,
                           resolve_model, trainable)
from common.multiturn import check_chat, trajectory_lengths, trajectory_metrics, turn_metrics, turn_stats
from common.rollout import (evaluate, micro_batches, rollout, rollout_to, run_reach, runs_prompts_once, token_logprobs,
                            trimmed)
from common.sampling import Rollout
from common.tasks import load_task


@dataclass
class Args:
    # ---------------------------------------------------------------- experiment
    seed: int = 0
    """seed of the prompt order, the sampling noise and the model's initial state"""
    run_name: str | None = None
    """name of the run directory under --output-dir (default: async_grpo__<task>__s<seed>__<unix time>)"""
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
    """optimisation steps; each trains on one batch from the generator"""
    prompts_per_step: int = 32
    """prompts per step"""
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
    """sampler of the generator: postrl's own, or vLLM in this process (common/engine.py; pip install -e '.[vllm]'): its
    log-probs are mu even at staleness 0, and offpolicy/engine_kl measures them against the trainer's at the same weights"""
    # ---------------------------------------------------------------- asynchrony
    mode: Literal["threaded", "emulated"] = "threaded"
    """threaded: a generation thread overlaps with training; emulated: no thread, batch t from exactly version t-1-K"""
    max_staleness: int = 1
    """K: no batch is trained more than K versions after the weights that sampled it"""
    drop_stale: bool = False
    """threaded only: let the generator run free (bounded by --queue-size) and drop batches staler than K, instead of pacing it"""
    sync_every: int = 1
    """threaded only: publish the learner's weights to the generator every this many steps (at most K + 1)"""
    queue_size: int = 2
    """threaded only: finished batches that may wait for the learner"""
    generator_device: str | None = None
    """device the generation thread samples on (e.g. cuda:1 beside a learner on cuda:0; default: the learner's)"""
    generator_threads: int | None = None
    """intra-op CPU threads of the generation thread (default: 1 when it samples on a CPU: a second OpenMP pool of
    all cores slows both threads, even at K = 0 where they take turns (benchmarks/results/compare_k0_pools.md);
    torch's on a GPU)"""
    learner_threads: int | None = None
    """intra-op CPU threads of the learner (default: torch's, all cores)"""
    # ---------------------------------------------------------------- algorithm
    correction: Literal["none", "tis", "decoupled", "m2po", "icepop", "seq-mask", "opsm", "cispo", "seq-tis", "seq-mis",
                        "vcpo"] = "tis"
    """off-policy correction for stale batches (see the docstring)"""
    tis_cap: float = 2.0
    """C of tis: the behaviour weight pi_old / mu is truncated at C"""
    decoupled_cap: float | None = None
    """decoupled: tokens whose behaviour weight pi_old / mu exceeds this get weight 0 (AReaL's cap; default: none dropped)"""
    m2po_threshold: float = 0.04
    """tau of m2po: tokens are masked until the mean (log pi_theta / mu)^2 of the rest is <= tau (before each pass)"""
    icepop_low: float = 0.5
    """a of icepop: tokens whose weight pi_old / mu is below a are dropped (IcePop's published band: [0.5, 5])"""
    icepop_high: float = 5.0
    """b of icepop: tokens whose weight pi_old / mu is above b are dropped"""
    seq_mask_cap: float = 1.001
    """C of seq-mask: a sequence whose geometric-mean weight leaves [1/C, C] is dropped (verl's geo-MIS default)"""
    opsm_delta: float = 1e-4
    """delta of opsm: a sequence with A < 0 and mean_t log(mu / pi_theta) > delta is dropped (the paper gives no value;
    1e-4 as public implementations)"""
    cispo_eps_low: float = 1.0
    """eps_low_is of cispo: the weight is raised to at least 1 - eps_low_is (1: no lower bound, as the paper sets it)"""
    cispo_eps_high: float = 0.28
    """eps_high_is of cispo: the weight is capped at 1 + eps_high_is (the paper tunes it and gives no value; 0.28 as
    public reproductions)"""
    seq_cap: float = 2.0
    """C of seq-tis and seq-mis: the sequence weight W = exp(sum_t log pi_old / mu) is truncated at C, or the sequence
    dropped where W leaves [1/C, C] (verl's rollout-correction default, 2)"""
    vcpo_cap: float = 8.0
    """vcpo: the sequence weight W truncated at this in the loss (8 in the paper's public recipe)"""
    lr: float = 5e-4
    """AdamW learning rate (5e-4 suits the embedded tiny model; ~1e-6 suits a 0.5B model)"""
    num_iterations: int = 1
    """optimisation passes over each batch, pi_old fixed; > 1 makes the clip on u bind"""
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
    """how per-token losses are averaged: GRPO | DAPO | Dr. GRPO (see common/losses.py); cispo: token-mean, its own"""
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


# Flags that may differ between a run and its resumption.
RESUMABLE = {"resume", "export_dtype", "steps", "save_every", "eval_every", "track", "eval_cache", "device", "run_name", "output_dir",
             "extra_eval_data_path", "microbatch_tokens", "generation_batch_size",
             "generator_threads", "learner_threads", "queue_size", "generator_device"}


def check_args(args: Args, num_processes: int) -> None:
    check(num_processes == 1, f"async_grpo.py runs as one process (a learner and a generation thread); "
                              f"it was launched as {num_processes}: run it without `accelerate launch --num_processes`")
    check(args.num_generations >= 2, f"--num-generations must be at least 2 (got {args.num_generations}): "
                                     "a group needs two completions to have a baseline")
    for flag, value, low in (("max-staleness", args.max_staleness, 0), ("sync-every", args.sync_every, 1), ("beta", args.beta, 0),
                             ("queue-size", args.queue_size, 1), ("generator-threads", args.generator_threads, 1),
                             ("learner-threads", args.learner_threads, 1), ("tis-cap", args.tis_cap, 1), ("steps", args.steps, 1),
                             ("num-iterations", args.num_iterations, 1), ("prompts-per-step", args.prompts_per_step, 1)):
        check(value is None or value >= low, f"--{flag} must be >= {low} (got {value})")
    check(args.mode == "threaded" or (args.sync_every == 1 and not args.drop_stale),
          "--sync-every and --drop-stale apply to --mode threaded (emulated mode samples from exactly version t-1-K)")
    check(args.drop_stale or args.sync_every <= args.max_staleness + 1,
          f"--sync-every ({args.sync_every}) must be at most --max-staleness + 1 ({args.max_staleness + 1}): with "
          "weights published less often the paced generator could never start a batch within K versions")
    check(args.generator_device is None or args.generator_device.startswith("cpu") or torch.cuda.is_available(),
          f"--generator-device {args.generator_device}: no CUDA device is available")
    for flag, value in (("m2po-threshold", args.m2po_threshold), ("seq-cap", args.seq_cap), ("vcpo-cap", args.vcpo_cap),
                        ("eps-high", args.eps_high), ("lr", args.lr), ("temperature", args.temperature)):
        check(value > 0, f"--{flag} must be > 0 (got {value})")
    check(args.decoupled_cap is None or args.decoupled_cap >= 1, f"--decoupled-cap must be >= 1 (got {args.decoupled_cap})")
    check(0 <= args.icepop_low <= 1 <= args.icepop_high, f"--icepop-low and --icepop-high must satisfy 0 <= low <= 1 <= "
                                                         f"high (got {args.icepop_low}, {args.icepop_high})")
    check(args.seq_mask_cap > 1, f"--seq-mask-cap must be > 1 (got {args.seq_mask_cap})")
    check(args.opsm_delta >= 0, f"--opsm-delta must be >= 0 (got {args.opsm_delta})")
    check(0 <= args.cispo_eps_low <= 1 and args.cispo_eps_high > 0, f"--cispo-eps-low must be in [0, 1] and --cispo-eps-high"
                                                                     f" > 0 (got {args.cispo_eps_low}, {args.cispo_eps_high})")
    check(0 < args.eps_low < 1, f"--eps-low must be in (0, 1) (got {args.eps_low})")
    check(0 < args.top_p <= 1 and args.top_k >= 0, f"--top-p must be in (0, 1] and --top-k >= 0 (got {args.top_p}, {args.top_k})")
    check(args.max_new_tokens is None or args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    check(1 <= args.minibatches <= args.prompts_per_step,
          f"--minibatches must be in [1, {args.prompts_per_step}] (micro-batches hold whole groups), got {args.minibatches}")
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


# ---------------------------------------------------------------- the generator side
@dataclass
class Batch:
    """One step's groups, as the generator hands them to the learner."""
    index: int  # generator batch number s: its prompts and noise keys are grpo.py's step s
    version: int  # policy version (learner steps) of the weights that sampled it
    rollout: Rollout
    rewards: torch.Tensor  # (P * G,) laid out group by group
    rollout_s: float  # time spent sampling and scoring it
    wait_s: float = 0.0  # time the generator waited (pacing or a full queue) before it could hand it over
    successes: torch.Tensor | None = None  # (P * G,) 1.0 where the completion or trajectory achieved the task
    parts: dict | None = None  # --reward functions' mean values, logged as reward/<name>
    mismatch: dict | None = None  # --engine vllm: the engine's log-probs against the trainer's, same weights


def generate(model, tokenizer, task, args: Args, index: int, version: int, eos_ids, device, learner_device,
             engine=None) -> Batch:
    """Batch s: the prompts grpo.py draws at step s, G completions each, keys (seed, s, prompt, g). With an engine
    (--engine vllm), sampled by it, holding the weights of model."""
    t0 = time.perf_counter()
    chosen = np.random.default_rng([args.seed, index]).choice(len(task.train), args.prompts_per_step, replace=False)
    rows = task.train.select(chosen.tolist())
    G = args.num_generations
    prompts = [p for p in rows["prompt"] for _ in range(G)]
    answers = [a for a in rows["answer"] for _ in range(G)]
    keys = [(args.seed, index, i, g) for i in range(args.prompts_per_step) for g in range(G)]
    if engine is not None:  # --engine vllm: pushed when the version changes (a batch is sampled by one set of weights)
        engine.sync(model, version)
    out = rollout(model, tokenizer, prompts, keys, args.max_new_tokens, args.temperature, eos_ids, device,
                  task.envs(answers), args.generation_batch_size, args.top_k, args.top_p, engine)  # envs: multi-turn only
    engine_mismatch = mismatch(model, out, args.temperature, args.top_k, args.top_p) if engine is not None else None
    parts = {}
    rewards, successes = (torch.tensor(x, device=learner_device).float() for x in task.score(out, answers, rows, parts))
    parts = {f"reward/{k}": sum(v) / len(v) for k, v in parts.items()}
    out = rollout_to(out, learner_device)  # sampled on the generator's device, trained on the learner's
    return Batch(index, version, out, rewards, time.perf_counter() - t0, successes=successes, parts=parts,
                 mismatch=engine_mismatch)


def snapshot(model) -> dict[str, torch.Tensor]:
    """A private copy of the trained weights (all of them, or a LoRA policy's adapters): what the generator
    loads can never be half-updated."""
    state = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    first = next(iter(state.values()), None)
    if first is not None and first.is_cuda:  # the copies are complete before another thread's stream reads them;
        torch.cuda.current_stream(first.device).synchronize()  # the learner's stream only, not the generator's sampling
    return state


def load_trained(model, state: dict) -> None:
    """Load a snapshot's trained weights; the frozen ones (LoRA's base) are shared and stay as they are."""
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    assert not unexpected, f"the snapshot does not fit the generator's model: {unexpected[:3]}"


def generator_copy(policy, device):
    """The generator's own model on `device`: a copy of the trained weights that, on the learner's device,
    shares every frozen one (with LoRA, the whole base model: only the adapters are held twice); on another
    device a full copy, moved there once. Later snapshots are copied across by the generator thread."""
    if torch.device(device) == next(policy.parameters()).device:
        frozen = {id(p): p for p in policy.parameters() if not p.requires_grad}
        return copy.deepcopy(policy, frozen).eval()
    return copy.deepcopy(policy).to(device).eval()


class WeightBoard:
    """The learner posts whole snapshots with their version; the generator takes the latest one."""

    def __init__(self, state: dict, version: int):
        self.state, self.version = state, version
        self.changed = threading.Condition()

    def publish(self, state: dict, version: int) -> None:
        with self.changed:
            self.state, self.version = state, version
            self.changed.notify_all()

    def latest(self, min_version: int, stop: threading.Event) -> tuple[dict, int]:
        """The latest snapshot, waiting until its version is at least min_version (or stop is set)."""
        with self.changed:
            while self.version < min_version and not stop.is_set():
                self.changed.wait(timeout=0.1)
            return self.state, self.version


class GeneratorThread:
    """Samples batch after batch with its own copy of the policy, paced so that batch s (trained at
    learner step s, learner version s - 1) comes from version >= s - 1 - K."""

    def __init__(self, model, board: WeightBoard, first_index: int, args: Args, make_batch, num_threads: int | None):
        self.model, self.board, self.args, self.make_batch, self.num_threads = model, board, args, make_batch, num_threads
        self.queue: queue.Queue[Batch] = queue.Queue(maxsize=args.queue_size)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, args=(first_index,), name="generator", daemon=True)

    def _loop(self, index: int) -> None:
        try:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)  # per thread: the OpenMP pool size of this thread
            device = next(self.model.parameters()).device
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            version, waited = None, 0.0
            last = None if self.args.drop_stale else self.args.steps  # paced: exactly the batches the learner trains on
            while not self.stop.is_set() and (last is None or index <= last):
                t0 = time.perf_counter()
                lowest = -1 if self.args.drop_stale else index - 1 - self.args.max_staleness  # the pacing rule
                state, latest = self.board.latest(lowest, self.stop)
                if self.stop.is_set():
                    return
                waited += time.perf_counter() - t0
                with torch.cuda.stream(stream) if stream else nullcontext():  # on a GPU, its own stream
                    if latest != version:  # between batches only: a batch is sampled by one set of weights
                        load_trained(self.model, state)
                        version = latest
                    batch = self.make_batch(self.model, index, version)
                if stream:
                    stream.synchronize()  # the batch is complete before the learner's stream reads it
                t0 = time.perf_counter()
                batch.wait_s = waited
                while not self.stop.is_set():
                    try:
                        self.queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                waited = time.perf_counter() - t0  # a full queue is waiting too; it counts for the next batch
                index += 1
        except BaseException as e:  # noqa: BLE001 -- handed to the learner, which re-raises it
            self.error = e

    def start(self) -> None:
        self.thread.start()

    def publish(self, state: dict, version: int) -> None:
        self.board.publish(state, version)

    def get(self, step: int | None = None) -> Batch:
        """The next batch (whichever step asks); re-raises a generator failure within a tenth of a second."""
        while True:
            if isinstance(self.error, ConfigError):  # a misbehaving reward function, say: its one-line error as it is
                raise self.error
            if self.error is not None:
                raise RuntimeError("the generation thread failed (its traceback is above)") from self.error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.error is None:
                    raise RuntimeError("the generation thread stopped without a batch") from None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class EmulatedGenerator:
    """No thread: batch t is sampled, when asked for, from exactly version max(t - 1 - K, 0)."""

    def __init__(self, model, lagged: dict[int, dict], args: Args, make_batch):
        self.model, self.args, self.make_batch = model, args, make_batch
        self.lagged = deque(sorted(lagged.items()))  # (version, snapshot), oldest first; the last K + 1 versions

    def publish(self, state: dict, version: int) -> None:
        self.lagged.append((version, state))
        while len(self.lagged) > self.args.max_staleness + 1:
            self.lagged.popleft()

    def get(self, step: int) -> Batch:
        version, state = self.lagged[0]
        assert version == max(step - 1 - self.args.max_staleness, 0), (version, step)
        load_trained(self.model, state)
        return self.make_batch(self.model, step, version)


# ---------------------------------------------------------------- the off-policy corrected objective
def m2po_mask(log_r: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's token mask M: drop the tokens with the largest second moment (log pi_theta / mu)^2,
    largest first, until the mean over the kept tokens is <= threshold (all of them if no non-empty
    set of kept tokens gets there). Returns 1 = kept, 0 = masked, 0 off the mask."""
    m2 = (log_r**2)[mask.bool()]
    n = len(m2)
    sorted_m2, order = torch.sort(m2, descending=True)
    dropped_sum = torch.cat([m2.new_zeros(1), torch.cumsum(sorted_m2, 0)[:-1]])  # the j largest, j = 0..n-1
    kept_mean = (m2.sum() - dropped_sum) / torch.arange(n, 0, -1, device=m2.device)  # M2 of the other n - j
    within = torch.nonzero(kept_mean <= threshold)
    n_drop = int(within[0]) if len(within) else n  # the fewest drops that satisfy the threshold
    keep = torch.ones_like(m2)
    keep[order[:n_drop]] = 0.0
    out = torch.zeros_like(log_r)
    out[mask.bool()] = keep
    return out


def async_loss(logps, old_logps, behav_logps, ref_logps, advantages, mask, args: Args, num_seqs, num_tokens,
               keep=None, turn_ids=None, max_turns=1):
    """Per-token corrected surrogate plus beta * KL, aggregated over the completion tokens (mask) with
    the whole batch's counts. keep is M2PO's mask M (m2po only). Tokens that m2po masks, or that decoupled,
    icepop, seq-mask or opsm drop, get weight 0 but stay in the denominator (M2PO's 1 / sum |o_i|, AReaL's
    behav_imp_weight_cap): dropping a token does not up-weight the others. With turn_ids (multi-turn),
    the clip and ratio statistics per model turn too."""
    A = advantages[:, None]
    w = torch.exp(old_logps - behav_logps)  # behaviour weight pi_old / mu (no gradient: both are fixed)
    log_W = ((old_logps - behav_logps) * mask).sum(-1, keepdim=True)  # log W_i = sum_t log w_it, a sequence's weight
    if args.correction in ("none", "m2po", "opsm", "cispo"):
        ratio = torch.exp(logps - behav_logps)  # r = pi_theta / mu
    else:
        ratio = torch.exp(logps - old_logps)  # u = pi_theta / pi_old; == 1 on the first pass
    dropped, capped = torch.zeros_like(w, dtype=torch.bool), torch.zeros_like(w, dtype=torch.bool)
    if args.correction == "m2po":
        surrogate = keep * ratio * A  # M r A, no clip: the mask is the trust region
        dropped = keep == 0
    elif args.correction == "cispo":  # sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) A log pi_theta
        weight = torch.clamp(ratio.detach(), 1 - args.cispo_eps_low, 1 + args.cispo_eps_high)
        surrogate, capped = weight * A * logps, weight != ratio.detach()
    elif args.correction == "vcpo":  # min(W, C') u A: no clip (its trust region is the ESS-scaled step)
        W = torch.exp(log_W.clamp(max=80.0))  # (capped below; exp stays finite)
        surrogate, capped = torch.clamp(W, max=args.vcpo_cap) * ratio * A, (W > args.vcpo_cap).expand_as(w)
    else:
        surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.eps_low, 1 + args.eps_high) * A)
    if args.correction == "tis":
        surrogate, capped = torch.clamp(w, max=args.tis_cap) * surrogate, w > args.tis_cap  # min(w, C): truncated
    elif args.correction == "decoupled":
        dropped = w > args.decoupled_cap if args.decoupled_cap is not None else dropped
        surrogate = torch.where(dropped, 0.0, w) * surrogate  # w, or 0 where w > cap: dropped, not truncated
    elif args.correction == "icepop":  # M(w) = w inside [a, b], 0 outside
        dropped = (w < args.icepop_low) | (w > args.icepop_high)
        surrogate = torch.where(dropped, 0.0, w) * surrogate
    elif args.correction == "seq-tis":  # min(W_i, C) on every token of y_i: a row is whole in every micro-batch
        W = torch.exp(log_W.clamp(max=80.0))
        surrogate, capped = torch.clamp(W, max=args.seq_cap) * surrogate, (W > args.seq_cap).expand_as(w)
    elif args.correction == "seq-mis":  # y_i dropped whole where W_i leaves [1/C, C]
        dropped = (log_W.abs() > math.log(args.seq_cap)).expand_as(w)
        surrogate = torch.where(dropped, 0.0, surrogate)
    elif args.correction in ("seq-mask", "opsm"):  # whole sequences: a row is whole in every micro-batch
        tokens = mask.sum(-1).clamp(min=1)
        if args.correction == "seq-mask":  # |mean_t log w_t| > log C: the geometric mean left [1/C, C]
            drop_seq = (((old_logps - behav_logps) * mask).sum(-1) / tokens).abs() > math.log(args.seq_mask_cap)
        else:  # A < 0 and mean_t log(mu / pi_theta) > delta
            drop_seq = (advantages < 0) & (((behav_logps - logps.detach()) * mask).sum(-1) / tokens > args.opsm_delta)
        dropped = drop_seq[:, None].expand_as(w)
        surrogate = torch.where(dropped, 0.0, surrogate)
    per_token = -surrogate
    if ref_logps is not None:
        per_token = per_token + args.beta * kl_estimate(logps, ref_logps, args.kl_estimator)
    agg = "token-mean" if args.correction == "cispo" else args.loss_agg  # CISPO's own normaliser: 1 / sum_i |o_i|
    loss = aggregate(per_token, mask, agg, num_seqs, num_tokens, args.max_new_tokens)
    with torch.no_grad():  # token sums of the diagnostics; divided by the token count after the step
        m = mask.bool()
        clip = args.correction not in ("m2po", "cispo", "vcpo")  # their trust region: the mask, the weight, the step
        clip_low, clip_high = (ratio < 1 - args.eps_low) & (A < 0) & clip, (ratio > 1 + args.eps_high) & (A > 0) & clip
        stats = {
            "ratio": ratio[m].sum(),
            "approx_kl": kl_estimate(old_logps, logps, "k3")[m].sum(),  # KL(pi_old || pi_theta): (u - 1) - log u
            "clip_low": clip_low[m].sum(),
            "clip_high": clip_high[m].sum(),
            "masked": dropped[m].sum(),  # tokens dropped (m2po's mask, decoupled's cap, icepop, seq-mask, opsm, seq-mis)
            "masked_seqs": ((dropped | ~m).all(-1) & m.any(-1)).sum(),  # sequences dropped whole
            "capped": capped[m].sum(),  # tokens whose weight was truncated (tis, seq-tis, vcpo) or clipped (cispo)
            "ratio_min": ratio[m].min() if m.any() else ratio.new_tensor(1.0),
            "ratio_max": ratio[m].max() if m.any() else ratio.new_tensor(1.0),
        }
        if turn_ids is not None:
            stats["by_turn"] = turn_stats(ratio, clip_low | clip_high, turn_ids, max_turns)
    return loss, stats


def behaviour_diagnostics(old_logps, behav_logps, advantages) -> dict[str, float]:
    """How far the sampler was from the learner: w = pi_old / mu over the batch's tokens (log-probs of those tokens,
    and each token's advantage). Besides the KL and the ESS, issue 34's early-warning candidates: the upper tail of w,
    the share of tokens whose probability moved by more than 2x, and the share of positive-advantage tokens above
    1.2 (the default clip's upper bound: those a clip against mu stops pushing up)."""
    w = torch.exp(old_logps - behav_logps)
    positive = advantages > 1e-3  # (a group of equal rewards can leave ~1e-4 of rounding; unequal ones give > 0.1)
    return {  # p99: the k-th smallest, k = ceil(0.99 n) (torch.quantile refuses more than 2^24 tokens)
        "offpolicy/behaviour_ratio_p99": w.kthvalue(math.ceil(0.99 * len(w))).values.item() if len(w) else 1.0,
        "offpolicy/moved_frac": ((old_logps - behav_logps).abs() > math.log(2)).float().mean().item(),
        "offpolicy/pos_above_1.2": (w[positive] > 1.2).float().mean().item() if positive.any() else 0.0,
        "offpolicy/behaviour_ratio_mean": w.mean().item(),
        "offpolicy/behaviour_ratio_max": w.max().item(),
        "offpolicy/behaviour_ratio_std": w.std().item() if len(w) > 1 else 0.0,
        "offpolicy/behaviour_kl": kl_estimate(behav_logps, old_logps, "k3").mean().item(),  # KL(mu || pi_old), samples of mu
        "offpolicy/ess": (w.sum() ** 2 / (len(w) * (w**2).sum())).item(),  # (sum w)^2 / (n sum w^2), 1 = on-policy
    }


def vcpo_advantages(policy, batch: Rollout, rewards: torch.Tensor, stale: bool, args: Args) -> tuple[torch.Tensor, dict]:
    """VCPO (Huang et al. 2026, "Stable Asynchrony", arXiv:2602.17616): each group's off-policy optimal baseline in
    place of its mean reward (no critic), and the step's learning-rate factor sqrt(ESS / B) (its rule for AdamW),

        b_g = sum_{i in g} W_i^2 ||h_i||^2 R_i / sum_{i in g} W_i^2 ||h_i||^2,      A_i = (R_i - b_g) / (std_g(R) + 1e-4)
        ESS = (sum_i W_i)^2 / sum_i W_i^2 over the batch's B sequences,             W_i = exp(sum_t log pi_old / mu)

    with h_i = grad log pi_theta(y_i | x) and W_i as the loss applies them (h_i / |y_i| under seq-mean-token-mean, W_i
    capped at --vcpo-cap): the variance-minimising baseline of the update taken, the paper's wherever W <= cap. The
    norms take a backward a sequence (the paper's per-trajectory pass). All-equal rewards keep A = 0."""
    params = [p for p in policy.parameters() if p.requires_grad]
    sq_norms, log_W = [], []
    for i in range(len(rewards)):
        mb = trimmed(batch, torch.tensor([i]))
        logps, _ = token_logprobs(policy, *mb.inputs, args.temperature, False, args.top_k, args.top_p)
        score = (logps * mb.completion_mask).sum()  # log pi_theta(y_i | x), over the model's tokens
        if args.loss_agg == "seq-mean-token-mean":
            score = score / mb.completion_mask.sum().clamp(min=1)
        grads = torch.autograd.grad(score, params, allow_unused=True)
        sq_norms.append(sum(g.float().pow(2).sum() for g in grads if g is not None))
        log_W.append(((logps.detach() - mb.logprobs) * mb.completion_mask).sum() if stale else logps.new_zeros(()))
    G, log_W, R = args.num_generations, torch.stack(log_W).float(), rewards.float().view(-1, args.num_generations)
    lw = log_W.clamp(max=math.log(args.vcpo_cap)).view(-1, G)  # the weight the loss applies: min(W, cap)
    weight = torch.exp(2 * (lw - lw.max(-1, keepdim=True).values)) * torch.stack(sq_norms).view(-1, G)  # up to a factor
    mean = R.mean(-1, keepdim=True)  # b_g as the mean plus a weighted deviation: exactly the mean where R is constant
    baseline = mean + (weight * (R - mean)).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp(min=1e-30)
    std = {"group": R.std(-1, keepdim=True), "batch": R.std(), "none": None}[args.scale_rewards]
    advantages = ((R - baseline) / (std + 1e-4) if std is not None else R - baseline).view(-1)
    v = torch.exp(log_W - log_W.max())  # the ESS does not change when every weight is scaled alike
    ess = (v.sum() ** 2 / (len(v) * (v**2).sum())).item()
    return advantages, {"offpolicy/seq_ess": ess, "offpolicy/vcpo_lr_scale": math.sqrt(ess),
                        "offpolicy/vcpo_baseline_shift": (baseline - mean).abs().mean().item()}


def optimise(policy, ref, optimizer, accelerator, batch: Rollout, advantages, stale: bool, args: Args,
             step: int, lr_scale: float = 1.0) -> dict[str, float]:
    """num_iterations passes over the batch, each one optimiser step accumulated over micro-batches of whole groups.
    pi_old is the learner's policy before the update: the first pass's log-probs. m2po needs the whole
    batch's second moment at the current weights before each pass's first gradient, so it gets them
    from an extra no-grad pass (on the first pass these are pi_old's). lr_scale multiplies the learning rate of this
    step's optimiser steps (VCPO's sqrt(ESS / B))."""
    mask = batch.completion_mask
    micro = micro_batches(batch, args.num_generations, args.minibatches, args.microbatch_tokens,
                          runs_prompts_once(policy))  # the budget counts a prompt per group, or per row
    ref_logps = [None] * len(micro)
    if ref is not None:  # pi_ref first (its logits never beside the policy's graph), under pi_theta's truncation
        with torch.no_grad():
            ref_logps = [token_logprobs(ref, *mb.inputs, args.temperature, False, args.top_k, args.top_p)[0] for mb in micro]
    old_logps, behav_logps, kl_ref, entropy = {}, {}, 0.0, 0.0

    def set_pi_old(j: int, logps: torch.Tensor) -> None:  # and mu: on a batch of staleness 0, mu is pi_old
        old_logps[j] = logps.detach()
        behav_logps[j] = micro[j].logprobs if stale else old_logps[j]

    def m2po_keep() -> list[torch.Tensor]:  # M from (log pi_theta / mu)^2 at the weights of this pass, over the batch
        with torch.no_grad():
            now = [token_logprobs(policy, *mb.inputs, args.temperature, False, args.top_k, args.top_p)[0] for mb in micro]
        for j, logps in enumerate(now):
            if j not in old_logps:
                set_pi_old(j, logps)
        def widen(x):  # micro-batches are trimmed: back to the batch's width for the mask over the whole batch
            return torch.nn.functional.pad(x, (0, mask.shape[1] - x.shape[1]))

        keep = m2po_mask(torch.cat([widen(now[j] - behav_logps[j]) for j in range(len(micro))]),
                         torch.cat([widen(mb.completion_mask) for mb in micro]), args.m2po_threshold)
        return [k[:, : mb.completion_mask.shape[1]] for k, mb in zip(keep.split([len(mb.rows) for mb in micro]), micro)]

    num_tokens = mask.sum()
    stats, grad_norms = [], []
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr * lr_scale
    try:
        for iteration in range(args.num_iterations):
            keep = m2po_keep() if args.correction == "m2po" else [None] * len(micro)
            for j, mb in enumerate(micro):  # attention on model and environment tokens; the loss on the model's only
                logps, token_entropy = token_logprobs(policy, *mb.inputs, args.temperature, iteration == 0, args.top_k,
                                                      args.top_p)
                if iteration == 0:  # the learner's weights before the update: pi_old, and the diagnostics measured at them
                    if j not in old_logps:
                        set_pi_old(j, logps)
                    entropy += (token_entropy * mb.completion_mask).sum()
                    if ref is not None:
                        kl_ref += (kl_estimate(old_logps[j], ref_logps[j], args.kl_estimator) * mb.completion_mask).sum()
                loss, step_stats = async_loss(logps, old_logps[j], behav_logps[j], ref_logps[j], advantages[mb.rows],
                                              mb.completion_mask, args, mask.shape[0], num_tokens, keep[j], mb.turn_ids,
                                              batch.max_turns)
                accelerator.backward(loss)
                stats.append({**step_stats, "loss": loss.detach()})
            pass_loss = sum(s["loss"] for s in stats[-len(micro):])  # this pass's loss: no NaN reaches the weights
            grad_norms.append(optimizer_step(optimizer, accelerator, policy, args.max_grad_norm, pass_loss, step))
    finally:  # the step's factor, for this step only (also when a non-finite loss stops the run)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr

    token_passes = max(num_tokens.item(), 1) * args.num_iterations
    metrics = {
        "loss": sum(s["loss"] for s in stats).item() / args.num_iterations,
        "policy/entropy": float(entropy) / mask.sum().item(),
        "policy/ratio_mean": sum(s["ratio"] for s in stats).item() / token_passes,
        "policy/ratio_min": torch.stack([s["ratio_min"] for s in stats]).min().item(),
        "policy/ratio_max": torch.stack([s["ratio_max"] for s in stats]).max().item(),
        "policy/clip_frac_low": sum(s["clip_low"] for s in stats).item() / token_passes,
        "policy/clip_frac_high": sum(s["clip_high"] for s in stats).item() / token_passes,
        "policy/approx_kl": sum(s["approx_kl"] for s in stats).item() / token_passes,
        "policy/grad_norm": torch.stack(grad_norms).mean().item(),
        "offpolicy/mask_frac": sum(s["masked"] for s in stats).item() / token_passes,
        "offpolicy/mask_seq_frac": (sum(s["masked_seqs"] for s in stats).item()
                                    / max(mask.any(-1).sum().item() * args.num_iterations, 1)),
        "offpolicy/cap_frac": sum(s["capped"] for s in stats).item() / token_passes,
        **behaviour_diagnostics(*(torch.cat([x[j][mb.completion_mask.bool()] for j, mb in enumerate(micro)]) for x in (
            old_logps, behav_logps, [advantages[mb.rows][:, None].expand_as(mb.completion_mask) for mb in micro]))),
    }
    if ref is not None:
        metrics["policy/kl_ref"] = float(kl_ref) / mask.sum().item()
    if batch.turn_ids is not None:  # multi-turn: clipping by position in the trajectory
        metrics.update(turn_metrics(sum(s["by_turn"] for s in stats)))
    return metrics


# ---------------------------------------------------------------- the loop
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
    run_name = args.run_name or f"async_grpo__{args.task}__s{args.seed}__{int(time.time())}"
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
    saved = load_state(checkpoint, optimizer) if checkpoint else {"step": -1, "extra": {}}
    start = saved["step"] + 1
    device, G, K = accelerator.device, args.num_generations, args.max_staleness
    writer = MetricsWriter(run_dir, args, args.track, args.wandb_project, resume_step=start - 1)

    # ---- the generator: its own copy of the weights, version = learner steps behind them
    generator_device = torch.device(args.generator_device) if args.generator_device else device
    sampler = generator_copy(policy, generator_device)
    version = max(start - 1, 0)
    engine = start_engine(args, model_path, policy, accelerator)  # --engine vllm: samples with the generator's weights

    def make_batch(model, index, version):
        return generate(model, tokenizer, task, args, index, version, eos_ids, generator_device, device, engine)

    if args.mode == "emulated":
        lagged = saved["extra"].get("lagged") or {version: snapshot(policy)}
        generator = EmulatedGenerator(sampler, lagged, args, make_batch)
    else:
        if args.learner_threads:
            torch.set_num_threads(args.learner_threads)
        generator_threads = args.generator_threads or (1 if generator_device.type == "cpu" else None)
        generator = GeneratorThread(sampler, WeightBoard(snapshot(policy), version), max(start, 1), args, make_batch,
                                    generator_threads)
        generator.start()

    def eval_now() -> dict:
        return evaluate(policy, tokenizer, task, args.eval_samples, args.eval_k, args.max_new_tokens,
                        args.temperature, eos_ids, device, args.seed, 0, 1, args.generation_batch_size, args.top_k, args.top_p,
                        args.eval_cache)

    stop = GracefulStop()
    bar = progress_bar(args.steps, initial=max(start - 1, 0), desc=run_dir.name)
    staleness_window, dropped = deque(maxlen=100), 0
    try:
        for step in range(start, args.steps + 1):
            if step == 0:  # the base policy: every curve starts here
                writer.log(0, eval_now())
                continue
            # ---- 1-3. take the next batch of scored groups (the generator drew prompts, sampled, scored)
            t0 = time.perf_counter()
            while True:
                batch = generator.get(step)
                staleness = step - 1 - batch.version  # the learner is at version step - 1
                if not (args.drop_stale and staleness > K):
                    break
                dropped += 1
            learner_wait_s = time.perf_counter() - t0
            assert staleness <= K, (staleness, K)  # pacing or dropping guarantees it
            # ---- 4. group-relative advantages
            rewards = batch.rewards
            advantages, vcpo = group_advantages(rewards, G, args.scale_rewards), {}
            # ---- 5. optimise, 6. publish the new weights (version step) to the generator
            t0 = time.perf_counter()
            off_policy = staleness > 0 or engine is not None  # with an engine, mu is its log-probs even at staleness 0
            if args.correction == "vcpo":  # VCPO's baseline replaces the group mean; its ESS scales the step
                advantages, vcpo = vcpo_advantages(policy, batch.rollout, rewards, off_policy, args)
            metrics = optimise(policy, ref, optimizer, accelerator, batch.rollout, advantages, off_policy, args, step,
                               vcpo.get("offpolicy/vcpo_lr_scale", 1.0))
            metrics.update(vcpo)
            train_s = time.perf_counter() - t0
            if step % args.sync_every == 0:  # emulated mode: every step (its --sync-every is 1)
                generator.publish(snapshot(policy), step)
            # ---- 7. log
            lengths = batch.rollout.completion_mask.sum(-1).float()
            staleness_window.extend([staleness] * len(rewards))
            rollout_s = batch.rollout_s
            metrics.update({
                "reward/mean": rewards.mean().item(),
                **(batch.parts or {}),
                **(batch.mismatch or {}),
                "reward/std": rewards.std().item(),
                "reward/group_std_mean": rewards.view(-1, G).std(dim=1).mean().item(),  # within-prompt spread
                "accuracy/train": batch.successes.mean().item(),
                "frac_reward_zero_std": frac_zero_std(rewards, G),
                "completions/mean_length": lengths.mean().item(),
                "completions/clipped_frac": 1.0 - batch.rollout.finished.float().mean().item(),
                "offpolicy/staleness_mean": float(staleness),  # one version per batch: mean = max for this step
                "offpolicy/staleness_max": float(staleness),
                "offpolicy/dropped_batches": float(dropped),
                "time/rollout_s": rollout_s,
                "time/train_s": train_s,
                "time/learner_wait_s": learner_wait_s,
                "time/generator_wait_s": batch.wait_s,
                "time/overlap": 1.0 - min(learner_wait_s / rollout_s, 1.0),  # share of sampling hidden behind training
                "throughput/samples_per_s": len(rewards) / (learner_wait_s + train_s),
                "throughput/tokens_per_s": lengths.sum().item() / (learner_wait_s + train_s),
                **device_memory(device),
            })
            if batch.rollout.turn_ids is not None:
                metrics.update(trajectory_metrics(trajectory_lengths(batch.rollout)))
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                metrics.update(eval_now())
            writer.log(step, metrics)
            writer.histogram(step, "offpolicy/staleness", staleness_window)
            bar.update(1)
            bar.set_postfix({k: f"{metrics[k]:.2f}" for k in ("reward/mean", "eval/pass@1") if k in metrics})
            # ---- 8. checkpoint (emulated mode keeps the lagged weights, so a resumed run samples what this one would)
            if step % args.save_every == 0 or step == args.steps or stop.requested:
                extra = {"lagged": dict(generator.lagged)} if args.mode == "emulated" else {}
                save_checkpoint(run_dir, step, accelerator.unwrap_model(policy), tokenizer, optimizer, extra=extra)
            if stop.requested:
                bar.close()
                print(f"stopped at step {step}; resume with --resume {run_dir}", file=sys.stderr)
                sys.exit(130)
    finally:
        if args.mode == "threaded":
            generator.close()
    bar.close()
    stop.restore()
    writer.close()
    print(f"run: {run_dir}")
    if args.export_dtype:  # a copy in the serving dtype; the checkpoints stay float32
        print(f"export: {export_model(run_dir, accelerator.unwrap_model(policy), tokenizer, args.export_dtype)}")
    rows = read_metrics(run_dir)
    print_summary(run_dir, args.steps, args.eval_k)
    trained = [r for r in rows if "throughput/samples_per_s" in r]
    if trained:
        samples = sum(args.prompts_per_step * G for _ in trained)
        seconds = sum(r["time/learner_wait_s"] + r["time/train_s"] for r in trained)
        print(f"throughput {samples / seconds:.1f} samples/s over {len(trained)} steps (learner wait + train time); "
              f"mean staleness {np.mean([r['offpolicy/staleness_mean'] for r in trained]):.2f}")


if __name__ == "__main__":
    run(main, tyro.cli(Args))
