"""Multi-turn rollouts: the model and an environment take turns in one growing sequence.

An environment, one per trajectory, made for one row of the task:

    env.reset(prompt) -> the first observation (the text the model sees first)
    env.step(turn)    -> (observation, reward, done)     turn: the model's turn, decoded
    env.success       -> whether the trajectory achieved the task (what pass@k counts, whatever the reward shaping)
    env.max_turns, env.max_tokens    the episode's limits: model turns, and tokens after the prompt

A trajectory is one sequence,

    x | y_1 o_1 y_2 o_2 ... y_K        y_k: the model's k-th turn (up to and including its EOS)
                                       o_k: the environment's observation after it

and the policy is trained on it as on one completion: pi(y_kt | x, y_1, o_1, ..., y_k<t). The
training mask (Rollout.completion_mask) is 1 on the model's tokens only: observations are context,
not actions. The attention mask (Rollout.attention_mask) is 1 on both. For a chat model an observation goes in as
a user message of its chat template (chat_observations): the sequence reads as the template renders the conversation. The trajectory reward is the
sum of the turn rewards (an outcome reward pays at the last turn only; a partial-progress reward
pays per correct turn).

Turn k is sampled with common.sampling.sample from the whole context so far (no KV cache kept across turns:
contexts are short and the code stays obvious), with the noise key (*key, k): a trajectory does not
depend on the others in its batch, as in single-turn sampling. It ends when the environment says
done, after max_turns model turns, or when max_tokens tokens follow the prompt (a model turn or an
observation that would run past the budget is cut there). As for one completion, a trajectory is finished when
every model turn ended with EOS, and done (Rollout.done) when the environment took its last turn.
"""

from __future__ import annotations

from typing import Protocol

import torch

from common.cli import ConfigError
from common.sampling import Rollout, completion_mask, encode_prompts, row_uniforms, sample


class Env(Protocol):
    max_turns: int
    max_tokens: int
    success: bool

    def reset(self, prompt: str) -> str: ...

    def step(self, turn: str) -> tuple[str, float, bool]: ...


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def right_pad(rows: list[list], value, dtype, device) -> torch.Tensor:
    out = torch.full((len(rows), max(1, max(map(len, rows)))), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out.to(device)


MARK = "\x00turn\x00"  # a placeholder model turn, found again in the rendered template


def chat_observations(tokenizer):
    """For a chat model, (observation text, the text of the model turn's end token or "") -> the text the chat template
    puts between the model's turn and its next turn with the observation as the user's message (SmolLM2:
    '<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n'), read off two renderings of the
    template, less the end token the model's turn already holds; the identity for a tokenizer without a template (the
    embedded chain). A template that rewrites an earlier turn when a later one is added cannot be continued token by
    token: refused in one line."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return lambda text, end: text
    first = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": MARK}]
    try:
        before = tokenizer.apply_chat_template(first, tokenize=False)
        after = tokenizer.apply_chat_template([*first, {"role": "user", "content": MARK}], tokenize=False,
                                              add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 -- a template that cannot render a user / assistant / user conversation
        raise ConfigError(f"this model's chat template cannot render a multi-turn conversation: {str(e)[:200]}") from None
    if not after.startswith(before) or before.count(MARK) != 1 or after[len(before):].count(MARK) != 1:
        raise ConfigError("this model's chat template rewrites earlier turns: a multi-turn task cannot be run on it")
    close = before[before.index(MARK) + len(MARK):]
    head, tail = after[len(before):].split(MARK)

    def observation(text: str, end: str) -> str:
        return (close.removeprefix(end) if end else close) + head + text + tail

    return observation


def check_chat(task, tokenizer) -> None:
    """Refuse, before a model is built, a multi-turn task on a chat template it cannot continue (chat_observations)."""
    if task.env is not None:
        chat_observations(tokenizer)


def multi_turn_rollout(model, tokenizer, envs: list[Env], prompts: list[str], keys: list[tuple[int, ...]],
                       max_new_tokens: int, temperature: float, eos_ids: list[int], device, top_k: int = 0,
                       top_p: float = 1.0):
    """One trajectory per env (repeat a row G times for a group); max_new_tokens is the budget of one model turn."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [env.reset(p) for env, p in zip(envs, prompts)], device)
    pad, chat = tokenizer.pad_token_id, chat_observations(tokenizer)
    context = [prompt_ids[b][prompt_mask[b].bool()].tolist() for b in range(len(envs))]
    tokens, turn_ids, logps = ([[] for _ in envs] for _ in range(3))  # after the prompt; turn -1: an observation
    turn_rewards, turn_texts = [[] for _ in envs], [[] for _ in envs]
    done, cut = [False] * len(envs), [False] * len(envs)  # cut: a model turn ended at its budget, not at EOS
    was_training = model.training
    model.eval()
    for k in range(max(env.max_turns for env in envs)):
        active = [b for b, env in enumerate(envs) if not done[b] and k < env.max_turns and len(tokens[b]) < env.max_tokens]
        if not active:
            break
        ids, mask = left_pad([context[b] + tokens[b] for b in active], pad, device)
        uniforms = row_uniforms([(*keys[b], k) for b in active], max_new_tokens, device) if temperature > 0 else None
        out, out_logps = sample(model, ids, mask, max_new_tokens, temperature, eos_ids, pad, uniforms, top_k, top_p)
        lengths = completion_mask(out, eos_ids)[0].sum(-1).tolist()
        for row, b in enumerate(active):
            room = envs[b].max_tokens - len(tokens[b])
            turn = out[row, : min(lengths[row], room)].tolist()
            cut[b] = cut[b] or not (turn and turn[-1] in eos_ids)
            tokens[b] += turn
            turn_ids[b] += [k] * len(turn)
            logps[b] += out_logps[row, : len(turn)].tolist()
            text = tokenizer.decode(turn, skip_special_tokens=True)
            observation, reward, done[b] = envs[b].step(text)
            turn_rewards[b].append(float(reward))
            turn_texts[b].append(text)
            if not done[b]:
                end = tokenizer.decode(turn[-1:]) if turn and turn[-1] in eos_ids else ""
                obs = tokenizer(chat(observation, end), add_special_tokens=False)["input_ids"][: room - len(turn)]
                tokens[b] += obs
                turn_ids[b] += [-1] * len(obs)
                logps[b] += [0.0] * len(obs)
    model.train(was_training)
    completion_ids = right_pad(tokens, pad, torch.long, device)
    turn_id = right_pad(turn_ids, -1, torch.long, device)
    attention = right_pad([[1] * len(t) for t in tokens], 0, torch.long, device)
    return Rollout(
        prompt_ids, prompt_mask, completion_ids, (turn_id >= 0).long(), right_pad(logps, 0.0, torch.float32, device),
        finished=torch.tensor([d and not c for d, c in zip(done, cut)], device=device), done=done,
        texts=tokenizer.batch_decode(tokens, skip_special_tokens=True),
        attention_mask=attention, rewards=[sum(r) for r in turn_rewards], successes=[env.success for env in envs],
        turn_rewards=turn_rewards, turn_texts=turn_texts, turn_ids=turn_id, max_turns=max(env.max_turns for env in envs),
    )


def turn_stats(ratio: torch.Tensor, clipped: torch.Tensor, turn_ids: torch.Tensor, max_turns: int) -> torch.Tensor:
    """Per model turn k (columns): token count, clipped tokens, sum of r and of r^2 (rows) - sums, so that
    micro-batches, passes and processes add up."""
    one_hot = torch.nn.functional.one_hot(turn_ids.clamp(min=0), max_turns).float() * (turn_ids >= 0)[..., None]
    per_token = torch.stack([torch.ones_like(ratio), clipped.float(), ratio, ratio**2], dim=-1)  # (B, T, 4)
    return torch.einsum("btk,bts->sk", one_hot, per_token.detach().float())


def turn_metrics(sums: torch.Tensor) -> dict[str, float]:
    """turns/clip_frac_t{k} and turns/ratio_std_t{k} (k = 1, 2, ...) from turn_stats summed over the step,
    and turns/ratio_std over all model tokens (the std of r, as a population)."""
    def std(n, r, r2) -> float:
        return max(r2 / n - (r / n) ** 2, 0.0) ** 0.5

    n, _, r, r2 = sums.sum(1).tolist()
    metrics = {"turns/ratio_std": std(n, r, r2)} if n > 0 else {}
    for k in range(sums.shape[1]):
        n, clipped, r, r2 = sums[:, k].tolist()
        if n > 0:
            metrics[f"turns/clip_frac_t{k + 1}"] = clipped / n
            metrics[f"turns/ratio_std_t{k + 1}"] = std(n, r, r2)
    return metrics


def trajectory_lengths(batch) -> torch.Tensor:
    """(B, 3): tokens after the prompt (model and environment), model tokens, model turns."""
    return torch.stack([batch.attention_mask.sum(-1), batch.completion_mask.sum(-1), batch.turn_ids.max(-1).values + 1],
                       dim=-1).float()


def trajectory_metrics(lengths: torch.Tensor) -> dict[str, float]:
    """Means over the (gathered) batch of trajectory_lengths."""
    tokens, model_tokens, turns = lengths.mean(0).tolist()
    return {"trajectory/tokens": tokens, "trajectory/model_tokens": model_tokens, "trajectory/turns": turns}
