"""Loss helpers: values on hand-computed inputs, and invariance to how a batch is split."""

import math

import pytest
import torch

from common.losses import LOSS_AGG_MODES, aggregate, frac_zero_std, group_advantages, kl_estimate, masked_whiten

# Two completions: lengths 2 and 3 (max_len 4), per-token losses 1..4 and 10..40 (masked ones are junk).
LOSS = torch.tensor([[1.0, 2.0, 99.0, 99.0], [10.0, 20.0, 30.0, 99.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])


def test_token_mean_divides_by_all_valid_tokens():
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 10 + 20 + 30) / 5)


def test_seq_mean_token_mean_averages_each_completion_first():
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 20.0) / 2)


def test_seq_mean_token_sum_norm_divides_by_completions_times_budget():
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(63 / (2 * 8))


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregate(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_whole_batch_counts_give_the_whole_batch_loss_and_gradient(mode):
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    whole = aggregate(logits**2, mask, mode, max_len=5)
    (grad_whole,) = torch.autograd.grad(whole, logits)

    total, grad_split = 0.0, torch.zeros_like(logits)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches
        part = aggregate(logits[rows] ** 2, mask[rows], mode, num_seqs=6, num_tokens=mask.sum(), max_len=5)
        grad_split += torch.autograd.grad(part, logits)[0]
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grad_split, grad_whole, atol=1e-7)


def test_masked_tokens_contribute_nothing_to_loss_or_gradient():
    x = torch.randn(2, 4, requires_grad=True)
    for mode in LOSS_AGG_MODES:
        loss = aggregate(x * 1e6, MASK, mode)  # huge values at masked positions would dominate if counted
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.all(grad[MASK == 0] == 0)


def test_kl_estimators_on_a_hand_computed_token():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(0.25 / 0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-log_r)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - log_r - 1)
    same = kl_estimate(logp, logp, "k3")
    assert same.item() == 0.0


def test_kl_estimators_are_unbiased_or_not_as_the_notes_say():
    """Samples from p = N(0,1), q = N(0.5, 1): KL(p||q) = 0.125. k1 and k3 are unbiased, k2 is close."""
    torch.manual_seed(0)
    x = torch.randn(400_000)
    logp = -0.5 * x**2
    logq = -0.5 * (x - 0.5) ** 2
    for estimator, tol in (("k1", 0.01), ("k3", 0.005), ("k2", 0.01)):
        assert kl_estimate(logp, logq, estimator).mean().item() == pytest.approx(0.125, abs=tol)
    assert (kl_estimate(logp, logq, "k3") >= -1e-7).all()  # non-negative up to rounding


# Two small categorical distributions: pi_old (the sampler) and pi_theta (the policy after an update).
PI_OLD = torch.tensor([0.5, 0.3, 0.15, 0.05])
PI_THETA = torch.tensor([0.7, 0.2, 0.05, 0.05])


def test_k3_of_old_against_new_averages_to_the_exact_kl_over_samples_of_pi_old():
    """policy/approx_kl: tokens come from pi_old, so kl_estimate(old, new) must estimate KL(pi_old || pi_theta).
    The swapped form exp(old - new) - (old - new) - 1 averages chi^2 - KL instead: it is pinned here too."""
    exact = (PI_OLD * (PI_OLD / PI_THETA).log()).sum().item()  # 0.118
    tokens = torch.multinomial(PI_OLD, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    old, new = PI_OLD.log()[tokens], PI_THETA.log()[tokens]
    assert kl_estimate(old, new, "k3").mean().item() == pytest.approx(exact, rel=0.01)
    # in expectation (a sum over the support, no sampling): exact to rounding
    expected = (PI_OLD * kl_estimate(PI_OLD.log(), PI_THETA.log(), "k3")).sum().item()
    assert expected == pytest.approx(exact, rel=1e-5)
    chi2 = (PI_OLD**2 / PI_THETA).sum().item() - 1
    swapped = (PI_OLD * kl_estimate(PI_THETA.log(), PI_OLD.log(), "k3")).sum().item()
    assert swapped == pytest.approx(chi2 - exact, rel=1e-5) and swapped > exact + 0.05  # 0.189 against 0.118


REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # two groups of 4


def test_group_advantages_scaled_by_the_group_std():
    adv = group_advantages(REWARDS, 4, "group")
    std1 = torch.tensor([1.0, 0, 0, 0]).std().item()  # unbiased: sqrt(0.25) = 0.5
    assert adv[0].item() == pytest.approx(0.75 / (std1 + 1e-4))
    assert adv[1].item() == pytest.approx(-0.25 / (std1 + 1e-4))
    assert adv[4:].tolist() == pytest.approx([0.25 / (0.5 + 1e-4)] * 2 + [-0.75 / (0.5 + 1e-4), 0.25 / (0.5 + 1e-4)])


def test_group_advantages_scaled_by_the_batch_std():
    adv = group_advantages(REWARDS, 4, "batch")
    std = REWARDS.std().item()
    assert adv[0].item() == pytest.approx(0.75 / (std + 1e-4))
    assert adv[6].item() == pytest.approx(-0.75 / (std + 1e-4))


def test_group_advantages_unscaled_are_centred_rewards():
    assert group_advantages(REWARDS, 4, "none").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25])


def test_all_equal_group_has_zero_advantage_and_counts_as_zero_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert group_advantages(rewards, 3, "group")[:3].tolist() == [0.0, 0.0, 0.0]
    assert frac_zero_std(rewards, 3) == 0.5


def test_masked_whiten_uses_only_valid_entries():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    w = masked_whiten(x, m)
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-4)
    assert w[0, 3].item() == 100.0


def approx_kl_stat(script: str, logps, old, mask) -> torch.Tensor:
    """The token sum each script logs as policy/approx_kl, on one hand-made batch."""
    import async_grpo
    import gapo
    import grpo
    import is_grpo
    import ppo

    n, A, zeros = mask.shape[0], torch.ones(mask.shape[0]), torch.zeros_like(logps)
    if script in ("grpo", "is_grpo"):
        module = {"grpo": grpo, "is_grpo": is_grpo}[script]
        _, stats = module.grpo_loss(logps, old, None, A, mask, module.Args(max_new_tokens=3), n, mask.sum())
    elif script == "gapo":
        _, stats = gapo.gapo_loss(logps, old, None, A, torch.full((n,), 0.2), torch.zeros(n, dtype=torch.long), mask,
                                  gapo.Args(max_new_tokens=3, eps_low=0.2, eps_high_max=0.28), n, mask.sum())
    elif script == "ppo":
        _, stats = ppo.ppo_loss(logps, old, zeros, zeros, zeros, zeros, zeros, mask, ppo.Args(), mask.sum())
    else:
        _, stats = async_grpo.async_loss(logps, old, old, None, A, mask, async_grpo.Args(max_new_tokens=3), n, mask.sum())
    return stats["approx_kl"]


@pytest.mark.parametrize("script", ["grpo", "gapo", "is_grpo", "ppo", "async_grpo"])
def test_every_script_logs_k3_of_kl_old_new_as_cleanrl_does(script):
    """policy/approx_kl = sum over tokens of (r - 1) - log r, r = pi_theta / pi_old, masked tokens excluded."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.3, 0.1]]))
    logps = torch.log(torch.tensor([[0.25, 0.4, 0.9], [0.6, 0.3, 0.7]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token is padding
    r = torch.tensor([0.5, 2.0, 1.0, 1.5, 1.0])
    expected = ((r - 1) - r.log()).sum().item()  # 0.193 + 0.307 + 0 + 0.095 + 0
    assert approx_kl_stat(script, logps, old, mask).item() == pytest.approx(expected, rel=1e-5)
