"""The embedded default models: tiny Llamas warm-started on a synthetic task with noisy labels.

    python -m common.embedded            # rebuild every embedded model into common/weights/
    python -m common.embedded reverse    # rebuild one

A 2-layer, 64-wide Llama with a character tokenizer is trained by supervised fine-tuning on the
task's prompts, where 70 % of the labels are replaced by a noisy label (tasks.NOISY_LABELS); the
multi-turn `chain` model on whole transcripts of 1-10 turns, each turn's label a random digit with
probability 0.3, the loss on the model's turns only. The result samples the right answer only some
of the time: a base policy that RL can improve, offline, in a minute on a CPU. The build is
deterministic (fixed seeds, fixed data order, one thread) and takes 1-3 minutes per task on one
CPU core (chain: 6).
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
from common.tasks import (CHAIN_MAX_TURNS, DATA_SEED, EMBEDDED_MODELS, EXAMPLES, NOISY_LABELS, chain_dataset, chain_example,
                          embedded_task)

NOISE = 0.7  # fraction of warm-start labels that are noisy
WARM_START_STEPS = {"reverse": 700, "reverse-long": 1500, "add": 1500, "chain": 1500}  # addition takes longer to pick up
WARM_START_LR = {"chain": 2e-3}  # 5e-3 otherwise; at 5e-3 the chain model stalled at chance for 250+ steps (measured)
CHAIN_NOISE = 0.3  # chain: each model turn's label is a random digit with this probability
CHAIN_TURNS = (1, 10)  # chain: transcripts of 1 to 10 model turns (one model serves every chain-N)


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


def chain_transcript(tokenizer, rng: random.Random, exclude: set[str]) -> tuple[list[int], list[int]] | None:
    """A multi-turn transcript "4+3=" 7<eos> "+5=" 2<eos> ...; each model turn adds the operand to the sum
    shown in the previous turn (so it is right given its context) except with probability CHAIN_NOISE,
    when it is a random digit. Loss on the model's turns (digit and EOS) only."""
    prompt, operands = chain_example(rng, rng.randint(*CHAIN_TURNS))
    if operands in exclude:
        return None
    ids = tokenizer.convert_tokens_to_ids(list(prompt))  # a character tokenizer: one id per character
    labels, shown = [-100] * len(ids), int(operands[0])
    for k, d in enumerate(operands[1:]):
        if k > 0:
            observation = tokenizer.convert_tokens_to_ids(list(f"+{d}="))
            ids, labels = ids + observation, labels + [-100] * len(observation)
        shown = rng.randrange(10) if rng.random() < CHAIN_NOISE else (shown + int(d)) % 10
        turn = tokenizer.convert_tokens_to_ids([str(shown)]) + [tokenizer.eos_token_id]
        ids, labels = ids + turn, labels + turn
    return ids, labels


def warm_start_example(task: str, tokenizer, rng: random.Random, exclude: set[str]) -> tuple[list[int], list[int]] | None:
    """Prompt + (noisy) label + EOS, loss only on the label and EOS; None if the prompt is held out."""
    if task == "chain":
        return chain_transcript(tokenizer, rng, exclude)
    prompt, answer = EXAMPLES[task](rng)
    if prompt in exclude:
        return None
    if rng.random() < NOISE:
        answer = NOISY_LABELS[task](answer, rng)
    p = tokenizer.convert_tokens_to_ids(list(prompt))
    a = tokenizer.convert_tokens_to_ids(list(answer)) + [tokenizer.eos_token_id]
    return p + a, [-100] * len(p) + a


def held_out(task: str) -> set[str]:
    """The held-out prompts (chain: operand sequences, of every length used in the README) never trained on."""
    if task == "chain":
        return {a for n in range(2, CHAIN_MAX_TURNS + 1) for a in chain_dataset(n, 128, DATA_SEED)["answer"]}
    return set(embedded_task(task).test["prompt"])


def warm_start_batch(task: str, tokenizer, batch_size: int, rng: random.Random, exclude: set[str]):
    """A right-padded batch of warm_start_example's."""
    input_ids, labels = [], []
    while len(input_ids) < batch_size:
        example = warm_start_example(task, tokenizer, rng, exclude)
        if example is not None:
            input_ids.append(example[0])
            labels.append(example[1])
    width = max(map(len, input_ids))
    ids = torch.full((batch_size, width), tokenizer.pad_token_id)
    lab = torch.full((batch_size, width), -100)
    for i, (x, y) in enumerate(zip(input_ids, labels)):
        ids[i, : len(x)], lab[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, (ids != tokenizer.pad_token_id).long(), lab


def build(task: str, out_dir: Path, steps: int | None = None, batch_size: int = 128, lr: float | None = None, seed: int = 0):
    """Warm-start a tiny model on `task` and save it (model + tokenizer) with save_pretrained."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same floating-point sums on every machine size
    try:
        steps = steps or WARM_START_STEPS[task]
        lr = lr or WARM_START_LR.get(task, 5e-3)
        torch.manual_seed(seed)
        rng = random.Random(seed)
        tokenizer = char_tokenizer()
        model = LlamaForCausalLM(tiny_llama_config(tokenizer))
        exclude = held_out(task)  # never train on the held-out prompts
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
    for task in tasks or EMBEDDED_MODELS:
        if task not in EMBEDDED_MODELS:
            sys.exit(f"unknown embedded task {task!r}; choose from {', '.join(EMBEDDED_MODELS)}")
        t0 = time.time()
        loss = build(task, WEIGHTS_DIR / task)
        print(f"{task}: final warm-start loss {loss:.3f}, {time.time() - t0:.0f}s -> {WEIGHTS_DIR / task}")


if __name__ == "__main__":
    main(sys.argv[1:])
