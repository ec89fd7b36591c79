"""The embedded default models: tiny Llamas warm-started on a synthetic task with noisy labels.

    python -m common.embedded            # rebuild every embedded model into common/weights/
    python -m common.embedded reverse    # rebuild one

A 2-layer, 64-wide Llama with a character tokenizer is trained by supervised fine-tuning on the
task's prompts, where 70 % of the labels are replaced by a noisy label (tasks.NOISY_LABELS). The
result samples the right answer only some of the time: a base policy that RL can improve, offline,
in a minute on a CPU. The build is deterministic (fixed seeds, fixed data order, one thread) and
takes 1-3 minutes per task on one CPU core.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.models import WEIGHTS_DIR, char_tokenizer
from common.tasks import EMBEDDED_TASKS, EXAMPLES, NOISY_LABELS, embedded_task

NOISE = 0.7  # fraction of warm-start labels that are noisy
WARM_START_STEPS = {"reverse": 700, "reverse-long": 1500, "add": 1500}  # addition takes longer to pick up


def tiny_llama_config(tokenizer, hidden: int = 64, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def save_char_tokenizer(tokenizer, out_dir: Path) -> None:
    """save_pretrained, naming the class that transformers 4.x and 5.x both load."""
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def warm_start_batch(task: str, tokenizer, batch_size: int, rng: random.Random, exclude: set[str]):
    """Prompt + (noisy) label + EOS, right-padded; loss only on the label and EOS."""
    input_ids, labels = [], []
    while len(input_ids) < batch_size:
        prompt, answer = EXAMPLES[task](rng)
        if prompt in exclude:
            continue
        if rng.random() < NOISE:
            answer = NOISY_LABELS[task](answer, rng)
        p = tokenizer.convert_tokens_to_ids(list(prompt))  # a character tokenizer: one id per character
        a = tokenizer.convert_tokens_to_ids(list(answer)) + [tokenizer.eos_token_id]
        input_ids.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, input_ids))
    ids = torch.full((batch_size, width), tokenizer.pad_token_id)
    lab = torch.full((batch_size, width), -100)
    for i, (x, y) in enumerate(zip(input_ids, labels)):
        ids[i, : len(x)], lab[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, (ids != tokenizer.pad_token_id).long(), lab


def build(task: str, out_dir: Path, steps: int | None = None, batch_size: int = 128, lr: float = 5e-3, seed: int = 0):
    """Warm-start a tiny model on `task` and save it (model + tokenizer) with save_pretrained."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same floating-point sums on every machine size
    try:
        steps = steps or WARM_START_STEPS[task]
        torch.manual_seed(seed)
        rng = random.Random(seed)
        tokenizer = char_tokenizer()
        model = LlamaForCausalLM(tiny_llama_config(tokenizer))
        exclude = set(embedded_task(task).test["prompt"])  # never train on the held-out prompts
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100) * (1 - s / steps))
        for step in range(steps):
            ids, mask, labels = warm_start_batch(task, tokenizer, batch_size, rng, exclude)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        out_dir.mkdir(parents=True, exist_ok=True)
        model.generation_config.do_sample = True
        model.save_pretrained(out_dir)
        save_char_tokenizer(tokenizer, out_dir)
        return loss.item()
    finally:
        torch.set_num_threads(threads)


def main(tasks: list[str]) -> None:
    for task in tasks or EMBEDDED_TASKS:
        if task not in EMBEDDED_TASKS:
            sys.exit(f"unknown embedded task {task!r}; choose from {', '.join(EMBEDDED_TASKS)}")
        t0 = time.time()
        loss = build(task, WEIGHTS_DIR / task)
        print(f"{task}: final warm-start loss {loss:.3f}, {time.time() - t0:.0f}s -> {WEIGHTS_DIR / task}")


if __name__ == "__main__":
    main(sys.argv[1:])
