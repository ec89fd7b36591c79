"""The training forward without wasted arithmetic: a group's prompt runs once for its G completions, micro-batches
hold whole groups trimmed to their own longest row, and the update is the one-batch update."""

import pytest
import torch
from accelerate import Accelerator
from conftest import latest_weights, small_args, state_dicts_equal

import grpo
from common.losses import group_advantages
from common.models import load_policy, load_reference, resolve_model
from common.rollout import micro_batches, rollout, token_logprobs, trimmed
from common.tasks import load_task

EMBEDDED = resolve_model("embedded", "reverse")


def groups_of(policy, tokenizer, task_name: str = "reverse", G: int = 4, prompts: int = 3):
    task = load_task(task_name, num_test=8)
    rows = task.test.select(range(prompts))
    answers = [a for a in rows["answer"] for _ in range(G)]
    return rollout(policy, tokenizer, [p for p in rows["prompt"] for _ in range(G)], [(2, i) for i in range(prompts * G)], 8,
                   1.0, [tokenizer.eos_token_id], "cpu", task.envs(answers))


def logps_and_gradient(policy, batch, share: bool):
    """Log-probs of a batch's completion tokens and the gradient of their sum, with or without shared prompts."""
    policy.zero_grad()
    logps, _ = token_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.attention_mask,
                              share_prompts=share)
    (logps * batch.completion_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    return logps.detach() * batch.completion_mask, grads


@pytest.mark.parametrize("setting", [dict(), dict(lora_r=4, lora_alpha=8.0), dict(dtype="bfloat16"), dict(task="chain-3")],
                         ids=["float32", "lora", "bf16", "multi-turn"])
def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_the_whole_forward(tokenizer, setting):
    """Up to rounding: the prompt's keys and values are computed once for the G rows instead of G times (other shapes),
    and its gradient is the sum of the G rows' (index_select's backward)."""
    setting = dict(setting)
    task_name = setting.pop("task", "reverse")
    policy = load_policy(resolve_model("embedded", task_name), None, grpo.Args(**setting))
    batch = groups_of(policy, tokenizer, task_name)
    whole, whole_grad = logps_and_gradient(policy, batch, share=False)
    shared, shared_grad = logps_and_gradient(policy, batch, share=True)
    atol = 1e-2 if setting.get("dtype") == "bfloat16" else 1e-5  # bf16 products round at 3 significant digits
    assert torch.allclose(shared, whole, atol=atol)
    assert torch.nn.functional.cosine_similarity(shared_grad, whole_grad, dim=0) > (0.999 if atol > 1e-5 else 0.999999)
    assert whole_grad.abs().sum() > 0


def test_a_shared_prompt_runs_once_and_checkpointing_falls_back_to_the_whole_forward(tokenizer):
    """The model sees 3 prompts (one per group) and then 12 completions; under gradient checkpointing transformers
    returns no cache in training mode, so every row runs its prompt in one forward."""
    for checkpointing, expected in ((False, [3, 12]), (True, [12])):
        policy = load_policy(EMBEDDED, None, grpo.Args(gradient_checkpointing=checkpointing))
        batch = groups_of(policy, tokenizer)
        calls = []
        hook = policy.register_forward_pre_hook(lambda module, args, kwargs: calls.append(len(kwargs["input_ids"])),
                                                with_kwargs=True)
        token_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        hook.remove()
        assert calls == expected, checkpointing


def test_micro_batches_hold_whole_groups_trimmed_to_their_own_longest_row(tokenizer):
    policy = load_policy(EMBEDDED, None, grpo.Args())
    task = load_task("reverse")
    G, prompts = 4, [p for p in task.test["prompt"][:8] for _ in range(4)]  # 3 to 5 digits: completions of 4 to 6 tokens
    batch = rollout(policy, tokenizer, prompts, [(0, i) for i in range(32)], 8, 1.0, [tokenizer.eos_token_id], "cpu")
    lengths = batch.completion_mask.sum(-1)
    for micro in (micro_batches(batch, G, count=3), micro_batches(batch, G, max_tokens=60)):
        rows = torch.cat([mb.rows for mb in micro])
        assert sorted(rows.tolist()) == list(range(32))  # every row once
        for mb in micro:
            assert sorted(mb.rows.tolist()) == sorted({g * G + i for g in (mb.rows // G).tolist() for i in range(G)})  # whole
            assert mb.completion_mask.shape[1] == lengths[mb.rows].max()  # no column of padding alone
            assert mb.prompt_mask[:, 0].any()  # left padding trimmed too
    budget = micro_batches(batch, G, max_tokens=60)
    assert len(budget) > 1 and all(len(mb.rows) // G * (mb.prompt_ids.shape[1] + G * mb.completion_ids.shape[1]) <= 60
                                   for mb in budget if len(mb.rows) > G)
    whole = trimmed(batch, torch.arange(32))
    with torch.no_grad():
        a, _ = token_logprobs(policy, *whole.inputs)
        parts = {int(r): lp for mb in budget for r, lp in zip(mb.rows, token_logprobs(policy, *mb.inputs)[0])}
    for r in range(32):
        n = int(lengths[r])
        assert torch.allclose(parts[r][:n], a[r, :n], atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_token_budget_bounds_the_tokens_each_micro_batch_runs(tokenizer, monkeypatch, checkpointing):
    """--microbatch-tokens counts what the forwards compute: each group's prompt once where the prompts are shared,
    every row's prompt under gradient checkpointing (no KV cache in training mode: every row runs its prompt)."""
    policy = load_policy(EMBEDDED, None, grpo.Args(gradient_checkpointing=checkpointing))
    batch = groups_of(policy, tokenizer, G=4, prompts=8)
    tokens, per_micro_batch, real = [], [], grpo.token_logprobs
    policy.register_forward_pre_hook(lambda module, args, kwargs: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True)

    def counted(model, prompt_ids, *a, **k):  # a micro-batch's rows, and the tokens its forwards ran
        tokens.clear()
        out = real(model, prompt_ids, *a, **k)
        per_micro_batch.append((len(prompt_ids), sum(tokens)))
        return out

    monkeypatch.setattr(grpo, "token_logprobs", counted)
    args = grpo.Args(microbatch_tokens=60, num_generations=4, max_new_tokens=8, beta=0.0)
    grpo.optimise(policy, None, torch.optim.SGD(policy.parameters(), lr=0.0), Accelerator(cpu=True), batch,
                  group_advantages(torch.rand(32), 4), args, step=1)
    assert len(per_micro_batch) > 1
    assert all(n <= 60 for rows, n in per_micro_batch if rows > 4), per_micro_batch  # a group alone may exceed it


def test_micro_batches_by_a_token_budget_take_the_one_batch_step(tmp_path):
    grpo.main(small_args(grpo, tmp_path / "one", steps=1, eval_every=0, beta=0.04))
    grpo.main(small_args(grpo, tmp_path / "budget", steps=1, eval_every=0, beta=0.04, microbatch_tokens=40))
    from common.logging import read_metrics

    one, budget = read_metrics(tmp_path / "one" / "run")[1], read_metrics(tmp_path / "budget" / "run")[1]
    assert budget["policy/grad_norm"] == pytest.approx(one["policy/grad_norm"], rel=1e-5)
    assert state_dicts_equal(latest_weights(tmp_path / "one" / "run"), latest_weights(tmp_path / "budget" / "run"), atol=5e-5)


def test_the_reference_runs_before_the_policy_so_its_logits_never_sit_beside_the_policys_graph(tokenizer, monkeypatch):
    policy, ref = load_policy(EMBEDDED, None, grpo.Args()), load_reference(EMBEDDED, grpo.Args())
    batch = groups_of(policy, tokenizer)
    order, real = [], grpo.token_logprobs
    monkeypatch.setattr(grpo, "token_logprobs", lambda model, *a, **k: (order.append("ref" if model is ref else "policy"),
                                                                        real(model, *a, **k))[1])
    advantages = group_advantages(torch.rand(12), 4)
    grpo.optimise(policy, ref, torch.optim.SGD(policy.parameters(), lr=0.0), Accelerator(cpu=True), batch, advantages,
                  grpo.Args(minibatches=3, num_generations=4, max_new_tokens=8), step=1)
    assert order == ["ref"] * 3 + ["policy"] * 3


@pytest.mark.parametrize("truncation", [dict(), dict(top_p=0.8)], ids=["full", "top_p"])
def test_the_output_layer_a_chunk_at_a_time_gives_the_log_probs_entropy_and_gradient_of_the_whole(tokenizer, monkeypatch,
                                                                                                   truncation):
    """chunked_logprobs with chunks of 7 positions (the checkpointed chunks' logits recomputed in the backward pass)
    against the output layer on all positions at once."""
    import common.rollout

    policy = load_policy(EMBEDDED, None, grpo.Args())
    batch = groups_of(policy, tokenizer)
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.attention_mask)
    results = {}
    for chunked in (False, True):
        monkeypatch.setattr(common.rollout, "CHUNK_BYTES", 7 * 4 * 61 if chunked else 2**40)  # 61: the vocabulary
        policy.zero_grad()
        logps, entropy = token_logprobs(policy, *inputs, 1.0, True, **truncation)
        (logps * batch.completion_mask).sum().backward()
        results[chunked] = logps.detach(), entropy, [p.grad.clone() for p in policy.parameters()]
    (a, ent_a, grad_a), (b, ent_b, grad_b) = results[False], results[True]
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(ent_a, ent_b, atol=1e-6)
    # gradients of up to ~8 summed in another order (chunks): float32 rounding, relative ~1e-6 (2.9e-6 / 7.8 seen here)
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(grad_a, grad_b))
    with torch.no_grad():
        logits, _ = common.rollout.completion_logits(policy, *inputs)
    plain, _ = common.rollout.logprobs_from_logits(logits, batch.completion_ids, **truncation)
    assert torch.allclose(a, plain, atol=1e-6)  # and the model's own output layer computes the same


def test_a_one_token_prompt_beside_longer_ones_shares_its_prompt_too(tiny_model, tokenizer):
    """Its row in the prompt pass (all but the last token) is all padding: still finite, still the whole forward's."""
    tiny_model.train()
    batch = rollout(tiny_model, tokenizer, ["1", "1", "12345>", "12345>"], [(0, i) for i in range(4)], 6, 1.0,
                    [tokenizer.eos_token_id], "cpu")
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    with torch.no_grad():
        whole, _ = token_logprobs(tiny_model, *inputs, share_prompts=False)
        shared, _ = token_logprobs(tiny_model, *inputs, share_prompts=True)
    m = batch.completion_mask.bool()
    assert torch.isfinite(shared[m]).all() and torch.allclose(shared[m], whole[m], atol=1e-5)
