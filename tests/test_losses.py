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
