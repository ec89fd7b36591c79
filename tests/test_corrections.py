"""async_grpo.py's corrections that drop tokens or whole sequences, or cap the weight and keep every gradient
(IcePop, geometric sequence masking, DeepSeek-V3.2's off-policy sequence masking, MiniMax-M1's CISPO): each on a
hand-made batch (which tokens and sequences drop, the loss, the gradient) and micro-batched against one batch
(tests/test_learning.py: 30 embedded steps learn with each; test_async_grpo.py: thresholds out of range refused)."""

import math

import pytest
import torch
from conftest import small_args
from test_async_grpo import loss_args

import async_grpo
from common.logging import read_metrics

# Two sequences: row 0 of 3 tokens (A = +1), row 1 of 2 tokens and a pad (A = -1). The behaviour weight w = pi_old / mu:
W = [[0.4, 1.1, 6.0], [1.0, 0.8, 1.0]]
A = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
N = 5  # tokens: token-mean divides by 5 whatever is dropped


def batch():
    """First pass (pi_theta = pi_old, u = 1, r = w): the log-probs of pi_theta as a leaf, pi_old's and mu's."""
    old = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.25, 1.0]]))
    behav = old - torch.log(torch.tensor(W))
    return old.clone().requires_grad_(), old, behav


def loss_of(correction, **flags):
    logps, old, behav = batch()
    args = loss_args(correction=correction, **flags)
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A, MASK, args, 2, MASK.sum())
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.item(), [x for row in (grad * MASK).tolist() for x in row], stats  # the gradient flattened, row-major


def test_icepop_weights_tokens_inside_the_band_by_w_and_drops_the_rest():
    """M(w) = w on [0.5, 5], 0 outside: w = 0.4 and w = 6 drop (and stay in the denominator)."""
    loss, grad, stats = loss_of("icepop")
    assert loss == pytest.approx(-(1.1 * 1 + 1.0 * -1 + 0.8 * -1) / N)
    assert grad == pytest.approx([0.0, -1.1 / N, 0.0, 1.0 / N, 0.8 / N, 0.0])  # d/dlogp of w u A at u = 1: w A
    assert stats["masked"].item() == 2 and stats["masked_seqs"].item() == 0


def test_seq_mask_drops_a_sequence_whose_geometric_mean_weight_leaves_the_band_and_keeps_the_rest_unweighted():
    """exp(mean log w): row 0 1.382 > C = 1.2, dropped whole; row 1 0.894 within [1/1.2, 1.2], trained unweighted."""
    geometric = [math.exp(sum(math.log(w) for w in row[:n]) / n) for row, n in zip(W, (3, 2))]
    assert geometric == pytest.approx([1.3821, 0.8944], abs=1e-4)
    loss, grad, stats = loss_of("seq-mask", seq_mask_cap=1.2)
    assert loss == pytest.approx(-(-1 - 1) / N)
    assert grad == pytest.approx([0.0, 0.0, 0.0, 1.0 / N, 1.0 / N, 0.0])
    assert stats["masked"].item() == 3 and stats["masked_seqs"].item() == 1


def test_opsm_drops_a_negative_advantage_sequence_that_drifted_and_trains_the_rest_as_none():
    """mean_t log(mu / pi_theta): row 0 -0.324 (and A > 0: never dropped), row 1 +0.112 > delta = 0.05 with A < 0:
    dropped. Row 0 as `none`: r = w clipped to [0.8, 1.2] with A > 0: 0.4 and 1.1 pass, 6 is clipped (no gradient)."""
    loss, grad, stats = loss_of("opsm", opsm_delta=0.05)
    assert loss == pytest.approx(-(0.4 + 1.1 + 1.2) / N)
    assert grad == pytest.approx([-0.4 / N, -1.1 / N, 0.0, 0.0, 0.0, 0.0])
    assert stats["masked"].item() == 2 and stats["masked_seqs"].item() == 1
    _, _, lenient = loss_of("opsm", opsm_delta=0.2)  # above row 1's drift: nothing dropped
    assert lenient["masked"].item() == 0


def test_cispo_caps_the_weight_and_keeps_every_tokens_gradient():
    """sg(clip(r, 1 - 1, 1 + 0.28)) A log pi_theta: w = 6 is capped at 1.28, still with a gradient; no token drops."""
    loss, grad, stats = loss_of("cispo")
    capped = [[0.4, 1.1, 1.28], [1.0, 0.8, 0.0]]
    logps, _, _ = batch()
    expected = -sum(capped[i][t] * A[i].item() * logps[i, t].item() * MASK[i, t].item() for i in range(2) for t in range(3)) / N
    assert loss == pytest.approx(expected)
    assert grad == pytest.approx([-0.4 / N, -1.1 / N, -1.28 / N, 1.0 / N, 0.8 / N, 0.0])
    assert stats["masked"].item() == 0 and stats["capped"].item() == 1


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_cispo_divides_by_the_token_count_whatever_the_loss_aggregation(loss_agg):
    """MiniMax-M1's 1 / sum_i |o_i|: under another --loss-agg the rows of other lengths would weigh differently."""
    logps, old, behav = batch()
    args = loss_args(correction="cispo", loss_agg=loss_agg)
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A, MASK, args, 2, MASK.sum())
    (grad,) = torch.autograd.grad(loss, logps)
    assert [x for row in (grad * MASK).tolist() for x in row] == pytest.approx(loss_of("cispo")[1])
    assert stats["clip_low"].item() == stats["clip_high"].item() == 0  # no PPO clip acts: the weight's cap is cap_frac


def test_a_lower_cispo_bound_caps_from_below_too():
    loss, grad, stats = loss_of("cispo", cispo_eps_low=0.5)  # r = 0.4 raised to 0.5
    assert grad[0] == pytest.approx(-0.5 / N) and stats["capped"].item() == 2


@pytest.mark.parametrize("correction", ["icepop", "seq-mask", "opsm", "cispo"])
def test_micro_batches_take_the_one_batch_step(tmp_path, correction):
    """A sequence mask sees the whole sequence: micro-batches hold whole groups, so every row's mask is computed
    on the row entire; the logged shares and the step are those of one batch (emulated K = 2: stale batches)."""
    flags = dict(steps=3, mode="emulated", max_staleness=2, correction=correction, eval_every=0, seq_mask_cap=1.01,
                 opsm_delta=1e-3)
    async_grpo.main(small_args(async_grpo, tmp_path / "one", **flags))
    async_grpo.main(small_args(async_grpo, tmp_path / "micro", minibatches=4, **flags))
    one, micro = read_metrics(tmp_path / "one" / "run")[1:], read_metrics(tmp_path / "micro" / "run")[1:]
    for a, b in zip(one, micro):
        for key in ("loss", "policy/grad_norm", "offpolicy/mask_frac", "offpolicy/mask_seq_frac", "offpolicy/cap_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert any(r["offpolicy/mask_frac"] + r["offpolicy/cap_frac"] > 0 for r in one[1:])  # the correction acted

