"""Loading the policy, the reference and the tokenizer, from a hub id or a local directory.

`--model embedded` (the default) means the tiny warm-started model shipped for the embedded task
(common/weights/<task>/, rebuilt by `python -m common.embedded`); it loads through the same
`from_pretrained` path as any hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no "Loading weights" bars between our own progress bar's lines

from common.cli import ConfigError
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


def resolve_model(model: str, task: str) -> str:
    """`embedded` -> the shipped directory of the task's tiny model; anything else unchanged."""
    if model != "embedded":
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


def load_model(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False):
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS
    (chat models often end a turn with a token other than the tokenizer's EOS)."""
    ids = {tokenizer.eos_token_id}
    config_eos = model.generation_config.eos_token_id
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


def load_reference(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """The frozen reference policy pi_ref (always the initial model, also when the policy resumes)."""
    ref = load_model(name_or_path, dtype, trust_remote_code).eval()
    ref.requires_grad_(False)
    return ref
