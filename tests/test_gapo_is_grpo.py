"""gapo.py (group-adaptive clipping) and is_grpo.py (importance-sampled prompts)."""

import numpy as np
import pytest
import torch
from conftest import latest_weights, small_args, state_dicts_equal, without_timing

import gapo
import grpo
import is_grpo
from common.cli import ConfigError
from common.logging import read_metrics
from common.losses import group_advantages


# ---------------------------------------------------------------- GAPO
def binary_group(c: int, k: int = 8) -> torch.Tensor:
    return torch.tensor([1.0] * c + [0.0] * (k - c))


@pytest.mark.parametrize("c", range(0, 9))
def test_adaptive_eps_high_for_k_8_and_every_c(c):
    k, eps_low, eps_high_max = 8, 0.2, 0.28
    advantages = group_advantages(binary_group(c, k), k, "none")
    eps_high = gapo.adaptive_eps_high(advantages, k, eps_low, eps_high_max)
    expected_correct = eps_low + (eps_high_max - eps_low) * (k - c) / (k - 1)  # the paper's eps_high(c)
    assert eps_high[:c].tolist() == pytest.approx([expected_correct] * c)  # correct completions, A = (k - c) / k > 0
    assert eps_high[c:].tolist() == pytest.approx([eps_low] * (k - c))  # A <= 0 keeps eps_low
    if c == 1:
        assert eps_high[0].item() == pytest.approx(eps_high_max)


def test_correct_per_group_counts_each_completions_group():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0.5])  # partial credit (0.5) is not correct
    assert gapo.correct_per_group(rewards, 4).tolist() == [1] * 4 + [2] * 4
    assert gapo.correct_per_group(torch.tensor([1.0, 1, 0, 0]), 2).tolist() == [2, 2, 0, 0]


def test_sequence_ratio_is_the_length_normalised_product_of_token_ratios():
    """s_i = (prod_t r_it)^(1/|y_i|) over the valid tokens; every token of y_i carries it."""
    args = gapo.Args(ratio_level="sequence", eps_low=0.5, eps_high_max=0.5, beta=0.0, loss_agg="seq-mean-token-mean",
                     max_new_tokens=3, num_generations=2)
    token_ratios = torch.tensor([[2.0, 0.5, 3.0], [1.5, 99.0, 99.0]])  # second completion has one valid token
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, 1.0])
    loss, stats = gapo.gapo_loss(torch.log(token_ratios), torch.zeros(2, 3), None, advantages, torch.full((2,), 0.5),
                                 torch.tensor([2, 2]), mask, args, 2, 4)
    s1, s2 = 3.0 ** (1 / 3), 1.5  # (2 * 0.5 * 3)^(1/3) and 1.5^(1/1)
    assert loss.item() == pytest.approx(-(s1 + s2) / 2)  # neither exceeds 1 + 0.5
    assert stats["ratio"].item() == pytest.approx(3 * s1 + s2)
    assert stats["ratio_min"].item() == pytest.approx(s1) and stats["ratio_max"].item() == pytest.approx(s2)


def test_gapo_with_eps_high_max_equal_to_eps_low_is_grpo_without_std_scaling(tiny_model, tokenizer):
    from common.rollout import rollout, token_logprobs

    prompts = [p for p in ["12>", "345>", "67>"] for _ in range(4)]
    batch = rollout(tiny_model, tokenizer, prompts, [(1, i) for i in range(12)], 6, 1.0, [tokenizer.eos_token_id], "cpu")
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0])
    advantages = group_advantages(rewards, 4, "none")
    with torch.no_grad():
        old, _ = token_logprobs(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    logps = old + 0.3 * torch.randn_like(old)  # a later pass: ratios away from 1, so clipping binds
    common = dict(beta=0.0, loss_agg="token-mean", max_new_tokens=6, num_generations=4)
    g_args = gapo.Args(ratio_level="token", eps_low=0.2, eps_high_max=0.2, **common)
    eps_high = gapo.adaptive_eps_high(advantages, 4, 0.2, 0.2)
    gapo_value, gapo_stats = gapo.gapo_loss(logps, old, None, advantages, eps_high, gapo.correct_per_group(rewards, 4),
                                            batch.completion_mask, g_args, 12, None)
    grpo_value, grpo_stats = grpo.grpo_loss(logps, old, None, advantages, batch.completion_mask,
                                            grpo.Args(eps_low=0.2, eps_high=0.2, scale_rewards="none", **common), 12, None)
    assert gapo_value.item() == pytest.approx(grpo_value.item(), abs=1e-7)
    assert gapo_stats["clip_low"] + gapo_stats["clip_high"] == grpo_stats["clip_low"] + grpo_stats["clip_high"] > 0


def test_gapo_smoke_run_logs_clip_fraction_by_c(tmp_path):
    gapo.main(small_args(gapo, tmp_path, steps=2, num_iterations=2, prompts_per_step=16, ratio_level="sequence"))
    rows = read_metrics(tmp_path / "run")
    by_c = [k for k in rows[1] if k.startswith("clip/frac_c")]
    assert by_c and all(0.0 <= rows[1][k] <= 1.0 for k in by_c)
    assert rows[1]["policy/clip_frac_low"] + rows[1]["policy/clip_frac_high"] > 0
    args = __import__("json").loads((tmp_path / "run" / "args.json").read_text())
    assert (args["eps_low"], args["eps_high_max"]) == (3e-3, 5e-3)  # the sequence-level defaults


def test_gapo_refuses_eps_high_max_below_eps_low(tmp_path):
    with pytest.raises(ConfigError, match="--eps-high-max must be >= --eps-low"):
        gapo.main(small_args(gapo, tmp_path, eps_low=0.2, eps_high_max=0.1))


# ---------------------------------------------------------------- IS-GRPO
def sampler_args(**overrides) -> is_grpo.Args:
    return is_grpo.Args(**{"sigma_init": 0.5, "sigma_floor": 0.05, **overrides})


def test_prompts_are_drawn_in_proportion_to_sigma_hat():
    """is_grpo.py's own draw, step after step: chi-square of 22,400 draws against q = sigma_hat / sum(sigma_hat)."""
    sigma_hat = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.0, np.nan])  # 0 -> floor 0.05, NaN -> init 0.5
    q = is_grpo.prompt_probs(sigma_hat, sampler_args())
    expected = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.5]) / 2.05
    assert q == pytest.approx(expected)
    draws = np.concatenate([is_grpo.draw_prompts(sigma_hat, sampler_args(), step) for step in range(1, 701)])
    counts, n = np.bincount(draws, minlength=len(q)), len(draws)
    chi2 = ((counts - n * q) ** 2 / (n * q)).sum()
    assert n == 700 * 32 and chi2 < 22.5  # the 0.999 quantile of a chi-square with 6 degrees of freedom
    uniform = is_grpo.draw_prompts(sigma_hat, sampler_args(prompt_weighting=True, prompts_per_step=7), 1)
    assert sorted(uniform) == list(range(7))  # the ablation: grpo.py's draw, without replacement


def test_equal_sigmas_give_uniform_sampling_and_the_grpo_loss(tiny_model, tokenizer):
    q = is_grpo.prompt_probs(np.full(10, 0.3), sampler_args())
    assert q == pytest.approx(np.full(10, 0.1))
    logps, old = torch.randn(4, 5), torch.randn(4, 5)
    mask, adv = torch.ones(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5])
    a, _ = is_grpo.grpo_loss(logps, old, old, adv, mask, is_grpo.Args(max_new_tokens=5), 4, 20)
    b, _ = grpo.grpo_loss(logps, old, old, adv, mask, grpo.Args(max_new_tokens=5), 4, 20)
    assert a.item() == b.item()


def test_sigma_estimate_is_a_running_average_of_the_group_stds():
    sigma_hat = np.full(3, np.nan)
    is_grpo.update_sigma(sigma_hat, np.array([0, 2]), np.array([0.4, 0.0]), decay=0.5)
    assert sigma_hat[0] == 0.4 and np.isnan(sigma_hat[1]) and sigma_hat[2] == 0.0
    is_grpo.update_sigma(sigma_hat, np.array([0]), np.array([0.2]), decay=0.5)
    assert sigma_hat[0] == pytest.approx(0.3)


def test_a_prompt_drawn_twice_in_a_batch_gets_one_update_with_its_groups_mean_std():
    """Prompt 0 drawn twice (group stds 0.2 and 0.4) from sigma_hat 0.6: one update with 0.3 -> 0.45, whatever
    the order of the draws (applying the average twice in a row would give 0.4 or 0.35)."""
    for chosen, stds in (([0, 1, 0], [0.2, 0.1, 0.4]), ([0, 0, 1], [0.4, 0.2, 0.1])):
        sigma_hat = np.array([0.6, np.nan])
        is_grpo.update_sigma(sigma_hat, np.array(chosen), np.array(stds), decay=0.5)
        assert sigma_hat.tolist() == pytest.approx([0.45, 0.1])


def test_is_grpo_draws_zero_variance_prompts_less_and_updates_sigma_with_its_decay(tmp_path, monkeypatch):
    """On a 16-prompt pool, once every prompt has been seen, a prompt whose groups were all equal (sigma_hat 0, drawn at
    the floor 0.05) is drawn several times less often than one with signal. --sigma-decay reaches the update: with 0
    sigma_hat is each prompt's last group std, and the checkpoint holds what the updates computed."""
    draws, updates = [], []
    draw, update = is_grpo.draw_prompts, is_grpo.update_sigma

    def recorded_draw(sigma_hat, args, step):
        draws.append((sigma_hat.copy(), draw(sigma_hat, args, step)))
        return draws[-1][1]

    def recorded_update(sigma_hat, chosen, group_std, decay):
        updates.append((chosen.copy(), group_std.copy(), decay))
        update(sigma_hat, chosen, group_std, decay)

    monkeypatch.setattr(is_grpo, "draw_prompts", recorded_draw)
    monkeypatch.setattr(is_grpo, "update_sigma", recorded_update)
    is_grpo.main(small_args(is_grpo, tmp_path, steps=12, train_size=16, eval_every=0, sigma_decay=0.0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert rows[-1]["sampling/seen_frac"] == 1.0 and rows[-1]["sampling/q_cv"] > 0.2
    per_prompt = {"floor": [], "signal": []}
    for sigma_hat, chosen in draws:
        if not np.isnan(sigma_hat).any():  # the pool has been seen: q is the estimates'
            floor = sigma_hat <= 0.05
            per_prompt["floor"].append(np.isin(chosen, np.flatnonzero(floor)).sum() / max(floor.sum(), 1))
            per_prompt["signal"].append(np.isin(chosen, np.flatnonzero(~floor)).sum() / max((~floor).sum(), 1))
    assert len(per_prompt["floor"]) >= 4 and np.mean(per_prompt["floor"]) < 0.5 * np.mean(per_prompt["signal"])
    assert {decay for *_, decay in updates} == {0.0}
    replayed = np.full(16, np.nan)
    for chosen, group_std, decay in updates:
        update(replayed, chosen, group_std, decay)
    saved = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1] / "state.pt", weights_only=True)
    assert np.array_equal(saved["extra"]["sigma_hat"].numpy(), replayed, equal_nan=True)
    last_visit = {x: group_std[chosen == x].mean() for chosen, group_std, _ in updates for x in chosen}  # decay 0
    assert all(replayed[x] == pytest.approx(std) for x, std in last_visit.items())


def test_is_grpo_resume_restores_the_sigma_estimates(tmp_path):
    is_grpo.main(small_args(is_grpo, tmp_path / "full", steps=4, save_every=2, train_size=16))
    is_grpo.main(small_args(is_grpo, tmp_path / "cut", steps=2, save_every=2, train_size=16))
    is_grpo.main(small_args(is_grpo, tmp_path / "cut", steps=4, save_every=2, train_size=16, resume=str(tmp_path / "cut" / "run")))
    assert without_timing(read_metrics(tmp_path / "cut" / "run")) == without_timing(read_metrics(tmp_path / "full" / "run"))
    assert state_dicts_equal(latest_weights(tmp_path / "cut" / "run"), latest_weights(tmp_path / "full" / "run"))


def test_prompt_weighting_turns_group_std_into_batch_std_normalisation():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])  # group stds 0.5, 0.577, 0
    centred = rewards.view(3, 4) - rewards.view(3, 4).mean(1, keepdim=True)
    stds = rewards.view(3, 4).std(1)
    plain = is_grpo.is_advantages(rewards, 4, prompt_weighting=False)
    assert plain.tolist() == pytest.approx((centred / (stds[:, None] + 1e-4)).flatten().tolist())
    weighted = is_grpo.is_advantages(rewards, 4, prompt_weighting=True)
    assert weighted.tolist() == pytest.approx((centred / stds.mean()).flatten().tolist(), rel=1e-3)


def test_the_prompt_weighting_ablation_draws_grpos_batch_and_weights_its_advantages(tmp_path):
    is_grpo.main(small_args(is_grpo, tmp_path / "ablation", steps=1, prompt_weighting=True, eval_every=0))
    grpo.main(small_args(grpo, tmp_path / "grpo", steps=1, eval_every=0))
    ablation, plain = read_metrics(tmp_path / "ablation" / "run")[1], read_metrics(tmp_path / "grpo" / "run")[1]
    assert ablation["sampling/distinct_prompts"] == 8 and ablation["reward/mean"] == plain["reward/mean"]  # the same batch
    assert ablation["policy/grad_norm"] != pytest.approx(plain["policy/grad_norm"], rel=1e-3)  # other advantages
