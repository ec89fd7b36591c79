"""async_grpo.py: staleness as specified, weights that never tear, each correction's loss by hand,
and the script end to end (it reduces to grpo.py at staleness 0, resumes, stops cleanly, fails loudly)."""

import sys
import time

import conftest
import pytest
import torch
from conftest import (assert_ctrl_c_checkpoints_and_exits_130, latest_weights, launch_two_processes, run_script,
                      state_dicts_equal, without_timing)

import async_grpo
import grpo
from common.cli import ConfigError
from common.logging import read_metrics
from common.rollout import rollout, token_logprobs


def small_args(tmp_path, **overrides) -> async_grpo.Args:
    return conftest.small_args(async_grpo, tmp_path, **overrides)


def loss_args(**overrides) -> async_grpo.Args:
    return async_grpo.Args(**{"beta": 0.0, "loss_agg": "token-mean", "max_new_tokens": 4, **overrides})


def one_token_batch(log_w: list[float], log_u: list[float], advantages: list[float]):
    """Tensors for async_loss: one token per sequence with pi_old / mu = exp(log_w) and pi_theta / pi_old = exp(log_u)."""
    behav = torch.full((len(log_w), 1), -1.0)
    old = behav + torch.tensor(log_w)[:, None]
    logps = (old + torch.tensor(log_u)[:, None]).requires_grad_()
    return logps, old, behav, torch.tensor(advantages), torch.ones(len(log_w), 1)


# ---------------------------------------------------------------- each correction's loss on a hand-made batch
def test_tis_multiplies_the_clipped_objective_by_the_behaviour_weight_truncated_at_c():
    logps, old, behav, A, mask = one_token_batch(log_w=[torch.log(torch.tensor(0.5)), torch.log(torch.tensor(3.0))],
                                                 log_u=[0.0, 0.0], advantages=[1.0, 1.0])
    loss, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="tis", tis_cap=2.0), 2, mask.sum())
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)  # w = 3 is truncated to C = 2
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[:, 0].tolist() == pytest.approx([-0.5 / 2, -2.0 / 2])  # d/dlogp of w u A at u = 1 is w A


def test_decoupled_clips_u_against_pi_old_and_weights_by_the_untruncated_behaviour_ratio():
    log3 = torch.log(torch.tensor(3.0)).item()
    logps, old, behav, A, mask = one_token_batch(log_w=[log3, log3], log_u=[0.0, torch.log(torch.tensor(1.5)).item()],
                                                 advantages=[1.0, 1.0])
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="decoupled"), 2, mask.sum())
    assert loss.item() == pytest.approx(-(3.0 * 1.0 + 3.0 * 1.2) / 2)  # u = 1.5 with A > 0 is clipped at 1.2
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[:, 0].tolist() == pytest.approx([-3.0 / 2, 0.0])  # the clipped token gets no gradient
    assert stats["clip_high"].item() == 1


def test_decoupled_cap_drops_the_token_where_tis_truncates_it():
    """AReaL's behav_imp_weight_cap: a token with w > C gets weight 0 and stays in the denominator; tis
    multiplies it by C. Where w <= C the two corrections are the same number."""
    log_w = [torch.log(torch.tensor(w)).item() for w in (0.5, 1.5, 3.0)]
    logps, old, behav, A, mask = one_token_batch(log_w=log_w, log_u=[0.0, 0.0, 0.0], advantages=[1.0, -1.0, 1.0])
    decoupled, stats = async_grpo.async_loss(logps, old, behav, None, A, mask,
                                             loss_args(correction="decoupled", decoupled_cap=2.0), 3, mask.sum())
    tis, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="tis", tis_cap=2.0), 3, mask.sum())
    assert decoupled.item() == pytest.approx(-(0.5 - 1.5 + 0.0) / 3)  # w = 3 > 2: dropped, the mean is still over 3
    assert tis.item() == pytest.approx(-(0.5 - 1.5 + 2.0) / 3)  # w = 3 truncated to 2
    (grad_decoupled,) = torch.autograd.grad(decoupled, logps)
    (grad_tis,) = torch.autograd.grad(tis, logps)
    assert grad_decoupled[:2].tolist() == grad_tis[:2].tolist()  # identical where w <= C
    assert grad_decoupled[2].item() == 0.0 and grad_tis[2].item() == pytest.approx(-2.0 / 3)
    assert stats["masked"].item() == 1


def test_none_clips_the_ratio_to_the_behaviour_policy():
    """The bypass: r = pi_theta / mu, here exp(log w + log u), clipped like PPO's ratio."""
    logps, old, behav, A, mask = one_token_batch(log_w=[0.5, -0.5], log_u=[0.0, 0.0], advantages=[1.0, -1.0])
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="none"), 2, mask.sum())
    r = torch.exp(torch.tensor([0.5, -0.5]))  # 1.65 (A > 0: clipped at 1.2), 0.61 (A < 0: clipped at 0.8)
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 0.8 * -1.0) / 2)
    assert stats["ratio"].item() == pytest.approx(r.sum().item())
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1


def test_at_one_pass_decoupled_without_a_cap_is_the_bypass_with_its_clip_opened():
    """On a batch's first pass pi_theta = pi_old (u = 1), so r = w u = w: decoupled's w * min(u A, clip(u) A) and
    the bypass's min(r A, clip(r) A) with the clip opened have the same gradient, w A per token. Neither bounds the
    weight (tis truncates it at C): the real-model study's K4_decoupled and K4_none_noclip runs (repro/README.md,
    "Corrections at K = 4 on the real model") are this one objective, equal in their logs up to float rounding."""
    log_w = [torch.log(torch.tensor(w)).item() for w in (0.3, 0.9, 1.6, 4.0, 9.0)]
    logps, old, behav, A, mask = one_token_batch(log_w=log_w, log_u=[0.0] * 5, advantages=[1.0, -1.0, 1.0, -0.5, 2.0])
    decoupled, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="decoupled"), 5, mask.sum())
    opened = loss_args(correction="none", eps_low=0.999, eps_high=1e6)  # the study's K4_none_noclip arm
    bypass, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, opened, 5, mask.sum())
    (grad_decoupled,) = torch.autograd.grad(decoupled, logps)
    (grad_bypass,) = torch.autograd.grad(bypass, logps)
    w = torch.exp(torch.tensor(log_w))
    assert grad_decoupled[:, 0].tolist() == pytest.approx((-w * A / 5).tolist(), rel=1e-5)
    assert grad_bypass[:, 0].tolist() == pytest.approx(grad_decoupled[:, 0].tolist(), rel=1e-5)
    tis, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="tis"), 5, mask.sum())
    (grad_tis,) = torch.autograd.grad(tis, logps)
    assert grad_tis[3:, 0].tolist() == pytest.approx((-2.0 * A[3:] / 5).tolist())  # w = 4, 9 truncated to C = 2


def test_m2po_masks_the_largest_second_moments_until_the_rest_is_within_the_threshold():
    log_w = torch.tensor([[0.0, 0.1, 0.3, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding: never counted, never kept
    # M2 = 0, 0.01, 0.09, 1: mean 0.275 > 0.04; without the 1: 0.0333 <= 0.04
    assert async_grpo.m2po_mask(log_w, mask, 0.04).tolist() == [[1, 1, 1, 0, 0]]
    # 0.0333 > 0.02; without 0.09 as well: 0.005 <= 0.02
    assert async_grpo.m2po_mask(log_w, mask, 0.02).tolist() == [[1, 1, 0, 0, 0]]
    assert async_grpo.m2po_mask(log_w, mask, 1.0).tolist() == [[1, 1, 1, 1, 0]]  # already within: nothing masked


def test_m2po_loss_is_unclipped_r_times_a_over_all_tokens_with_the_masked_ones_zero():
    """The paper's objective, 1 / sum_i |o_i| sum_it M_it r_it A_it: masked tokens keep their place in the
    denominator, so masking one token does not up-weight the others."""
    logps, old, behav, A, mask = one_token_batch(log_w=[0.0, 0.1, 2.0], log_u=[0.7, 0.0, 0.0], advantages=[1.0, 1.0, 1.0])
    keep = async_grpo.m2po_mask(logps.detach() - behav, mask, 0.04)
    assert keep[:, 0].tolist() == [0.0, 1.0, 0.0]  # (log r)^2 = 0.49, 0.01, 4: the two largest go
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="m2po"), 3, mask.sum(), keep)
    assert loss.item() == pytest.approx(-torch.exp(torch.tensor(0.1)).item() / 3)  # r = 1.105 kept; divided by 3 tokens
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[[0, 2], 0].tolist() == [0.0, 0.0]
    assert stats["masked"].item() == 2 and stats["clip_low"].item() == stats["clip_high"].item() == 0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_m2po_with_every_token_masked_is_a_zero_loss_not_nan(loss_agg):
    logps, old, behav, A, mask = one_token_batch(log_w=[1.0, -1.0, 2.0], log_u=[0.0, 0.0, 0.0], advantages=[1.0, -1.0, 1.0])
    keep = async_grpo.m2po_mask(logps.detach() - behav, mask, 0.04)  # every (log r)^2 >= 1 > tau
    assert keep.sum().item() == 0
    loss, _ = async_grpo.async_loss(logps, old, behav, None, A, mask, loss_args(correction="m2po", loss_agg=loss_agg), 3,
                                    mask.sum(), keep)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == 0.0 and torch.all(grad == 0)


def test_m2po_recomputes_its_mask_at_every_pass_from_the_current_policy(tiny_model, tokenizer, monkeypatch):
    """With several passes the second pass's mask comes from (log pi_theta / mu)^2 at the weights after the
    first step, not from pi_old's: on a batch sampled by the learner's own weights, log r is 0 on pass 1
    (nothing masked) and not on pass 2 (tokens masked)."""
    prompts = ["12>", "4321>", "98>", "555>"] * 4
    batch = rollout(tiny_model, tokenizer, prompts, [(0, i) for i in range(16)], 6, 1.0, [tokenizer.eos_token_id], "cpu")
    calls, m2po_mask = [], async_grpo.m2po_mask

    def recording_mask(log_r, mask, threshold):
        calls.append((log_r.clone(), m2po_mask(log_r, mask, threshold)))
        return calls[-1][1]

    monkeypatch.setattr(async_grpo, "m2po_mask", recording_mask)
    from accelerate import Accelerator

    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=1.0)
    args = loss_args(correction="m2po", num_iterations=2, m2po_threshold=1e-3, max_grad_norm=1e9)
    metrics = async_grpo.optimise(tiny_model, None, optimizer, Accelerator(cpu=True), batch, torch.tensor([1.0, -1.0] * 8),
                                  True, args, step=1)
    m = batch.completion_mask.bool()
    assert len(calls) == 2  # one mask per pass
    (log_r1, keep1), (log_r2, keep2) = calls
    assert log_r1[m].abs().max() < 1e-5 and keep1[m].min() == 1  # pass 1: pi_theta = pi_old = mu
    assert log_r2[m].abs().max() > 0.05 and keep2[m].min() == 0  # pass 2: the policy moved, tokens masked
    assert metrics["offpolicy/mask_frac"] == pytest.approx((1 - keep2[m].mean().item()) / 2)


# ---------------------------------------------------------------- staleness and weights
def test_emulated_staleness_k_is_exactly_k_after_warm_up(tmp_path):
    async_grpo.main(small_args(tmp_path, steps=5, mode="emulated", max_staleness=2, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]  # version max(t - 1 - K, 0)
    assert all(r["offpolicy/behaviour_kl"] > 0 for r in rows[1:])  # stale batches are off-policy


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled", "m2po"])
def test_emulated_staleness_zero_is_grpo_bit_for_bit(tmp_path, correction):
    """Bit for bit by construction: the same batches (grpo.py's prompts and noise keys), sampled by a copy of the same
    weights, and at staleness 0 each correction is GRPO's objective with w = pi_old / mu = exp(0) = 1 exactly; so the
    same kernels run on the same numbers. (m2po with the generator on a device of its own: its own full copy of the
    weights, snapshots copied across, batches handed back to the learner's device. On a CPU, "cpu:0" is another device
    name for the same memory.)"""
    on_its_own = {"generator_device": "cpu:0" if conftest.DEVICE == "cpu" else "cuda:0"} if correction == "m2po" else {}
    async_grpo.main(small_args(tmp_path / "async", steps=3, mode="emulated", max_staleness=0, correction=correction,
                               **on_its_own))
    grpo.main(conftest.small_args(grpo, tmp_path / "grpo", steps=3))
    ours, theirs = without_timing(read_metrics(tmp_path / "async" / "run")), without_timing(read_metrics(tmp_path / "grpo" / "run"))
    assert [{k: a[k] for k in b} for a, b in zip(ours, theirs)] == theirs
    assert state_dicts_equal(latest_weights(tmp_path / "async" / "run"), latest_weights(tmp_path / "grpo" / "run"))


def test_published_weights_never_tear_and_behaviour_logprobs_match_their_version(tiny_model, tokenizer):
    """The learner publishes new weights as fast as it can while the generator samples; every batch's
    recorded log mu equals a fresh forward pass of the weights of the version it is tagged with."""
    args = loss_args(drop_stale=True, queue_size=4)
    prompts, published = ["12>", "4321>", "9>"], {0: async_grpo.snapshot(tiny_model)}

    def make_batch(model, index, version):
        out = rollout(model, tokenizer, prompts, [(index, i) for i in range(3)], 6, 1.0, [tokenizer.eos_token_id], "cpu")
        return async_grpo.Batch(index, version, out, torch.zeros(3), 0.0)

    board = async_grpo.WeightBoard(published[0], 0)
    generator = async_grpo.GeneratorThread(async_grpo.copy.deepcopy(tiny_model), board, 1, args, make_batch, None)
    generator.start()
    batches, version = [], 0
    while len(batches) < 12:
        with torch.no_grad():
            for p in tiny_model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        version += 1
        published[version] = async_grpo.snapshot(tiny_model)
        board.publish(published[version], version)
        while not generator.queue.empty():
            batches.append(generator.get())
    generator.close()
    assert len({b.version for b in batches}) > 3  # many versions were sampled from
    checker = async_grpo.copy.deepcopy(tiny_model)
    for b in batches:
        checker.load_state_dict(published[b.version])
        out = b.rollout
        with torch.no_grad():
            logps, _ = token_logprobs(checker, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
        assert torch.allclose(logps * out.completion_mask, out.logprobs, atol=1e-5), b.version
        if b.version > 0:  # and not those of the neighbouring versions (one step of noise moves them by ~1e-2)
            checker.load_state_dict(published[b.version - 1])
            with torch.no_grad():
                before, _ = token_logprobs(checker, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
            assert (before - logps).abs().max() > 1e-3


def instant_generator(args, made: list):
    """A started generation thread whose batches cost nothing (left alone it would run far ahead: only pacing and
    --steps hold it back); made records each batch's (index, version)."""
    def make_batch(model, index, version):
        made.append((index, version))
        return async_grpo.Batch(index, version, None, torch.zeros(1), 0.0)

    board = async_grpo.WeightBoard({}, 0)
    generator = async_grpo.GeneratorThread(torch.nn.Linear(1, 1), board, 1, args, make_batch, None)
    generator.start()
    return board, generator


def test_pacing_keeps_a_fast_generator_within_k_versions_of_a_slow_learner():
    K, made = 1, []
    board, generator = instant_generator(loss_args(max_staleness=K, queue_size=8), made)
    staleness, waits = [], []
    for step in range(1, 9):
        batch = generator.get()
        assert batch.index == step
        staleness.append(step - 1 - batch.version)
        waits.append(batch.wait_s)
        time.sleep(0.05)  # the learner's "training"
        board.publish({}, step)
    generator.close()
    assert max(staleness) <= K and staleness.count(K) >= 4  # it runs up to K ahead, never more
    assert max(index - 1 - version for index, version in made) <= K
    assert sum(waits) > 0.2  # it waited for the learner


def test_the_paced_generator_samples_exactly_the_batches_trained_on_and_then_stops():
    made = []
    board, generator = instant_generator(loss_args(max_staleness=2, queue_size=8, steps=5), made)
    for step in range(1, 6):
        assert generator.get().index == step
        board.publish({}, step)
    generator.thread.join(timeout=2)
    assert not generator.thread.is_alive() and [index for index, _ in made] == [1, 2, 3, 4, 5]  # no batch sampled for a step that never comes


def test_on_a_cpu_the_generator_samples_with_one_intra_op_thread_and_the_learner_keeps_all(tmp_path, monkeypatch):
    seen = {}
    generate = async_grpo.generate

    def watched(*args, **kwargs):
        seen["generator"] = torch.get_num_threads()
        return generate(*args, **kwargs)

    monkeypatch.setattr(async_grpo, "generate", watched)
    learner = torch.get_num_threads()
    async_grpo.main(small_args(tmp_path, steps=2, eval_every=0))
    assert seen["generator"] == 1 and torch.get_num_threads() == learner
    async_grpo.main(small_args(tmp_path / "two", steps=2, eval_every=0, generator_threads=2))
    assert seen["generator"] == 2
    async_grpo.main(small_args(tmp_path / "k0", steps=2, eval_every=0, max_staleness=0))  # taking turns: still one
    assert seen["generator"] == 1


def test_threaded_runs_report_staleness_overlap_and_the_off_policy_diagnostics(tmp_path):
    async_grpo.main(small_args(tmp_path, steps=6, max_staleness=1, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert all(0 <= r["offpolicy/staleness_max"] <= 1 for r in rows)
    assert all(0.0 <= r["time/overlap"] <= 1.0 and r["time/learner_wait_s"] >= 0 for r in rows)
    for key in ("time/rollout_s", "time/train_s", "time/generator_wait_s", "throughput/samples_per_s",
                "throughput/tokens_per_s", "offpolicy/ess", "offpolicy/behaviour_ratio_max", "offpolicy/mask_frac",
                "policy/entropy", "policy/clip_frac_low", "offpolicy/dropped_batches"):
        assert key in rows[-1], key


def test_drop_stale_drops_the_batches_a_free_running_generator_made_too_early(tmp_path, monkeypatch):
    """K = 0 with a slow learner: while it trains step t, the generator fills the queue from version t - 1, which is
    stale once step t publishes; those batches are dropped, and every batch trained on is fresh."""
    optimise = async_grpo.optimise
    monkeypatch.setattr(async_grpo, "optimise", lambda *a, **k: (time.sleep(0.2), optimise(*a, **k))[1])
    async_grpo.main(small_args(tmp_path, steps=4, max_staleness=0, drop_stale=True, queue_size=2, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert rows[-1]["offpolicy/dropped_batches"] > 0
    assert all(r["offpolicy/staleness_max"] == 0 for r in rows)


def test_sync_every_2_publishes_every_other_version(tmp_path):
    """The generator only ever holds published weights: versions 0, 2, 4, ...; a batch trained at step t came from
    version t - 1 - staleness."""
    async_grpo.main(small_args(tmp_path, steps=6, max_staleness=1, sync_every=2, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    versions = [r["step"] - 1 - r["offpolicy/staleness_max"] for r in rows]
    assert all(v % 2 == 0 for v in versions) and max(versions) >= 2, versions


def test_the_decoupled_cap_drops_the_tokens_whose_behaviour_weight_exceeds_it(tmp_path):
    """Emulated K = 2, cap 1: on a stale batch about half the tokens have pi_old / mu > 1 and are dropped; on the
    fresh first batch w = 1 everywhere and none is."""
    async_grpo.main(small_args(tmp_path, steps=3, mode="emulated", max_staleness=2, correction="decoupled",
                               decoupled_cap=1.0, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert rows[0]["offpolicy/staleness_max"] == 0 and rows[0]["offpolicy/mask_frac"] == 0.0
    assert all(r["offpolicy/staleness_max"] > 0 and 0.1 < r["offpolicy/mask_frac"] < 0.9 for r in rows[1:])


# ---------------------------------------------------------------- the script end to end
def test_emulated_resume_restores_the_lagged_weights(tmp_path):
    flags = dict(mode="emulated", max_staleness=2, save_every=2)
    async_grpo.main(small_args(tmp_path / "full", steps=4, **flags))
    async_grpo.main(small_args(tmp_path / "cut", steps=2, **flags))
    async_grpo.main(small_args(tmp_path / "cut", steps=4, resume=str(tmp_path / "cut" / "run"), **flags))
    full, resumed = tmp_path / "full" / "run", tmp_path / "cut" / "run"
    assert without_timing(read_metrics(resumed)) == without_timing(read_metrics(full))
    assert state_dicts_equal(latest_weights(resumed), latest_weights(full))


@pytest.mark.parametrize("overrides, message", [
    ({"max_staleness": -1}, "--max-staleness must be >= 0"),
    ({"sync_every": 3, "max_staleness": 1}, "--sync-every \\(3\\) must be at most --max-staleness \\+ 1"),
    ({"mode": "emulated", "drop_stale": True}, "apply to --mode threaded"),
    ({"tis_cap": 0.5}, "--tis-cap must be >= 1"),
    ({"m2po_threshold": 0.0}, "--m2po-threshold must be > 0"),
    ({"generator_threads": 0}, "--generator-threads must be >= 1"),
    ({"icepop_low": 1.5}, r"--icepop-low and --icepop-high must satisfy 0 <= low <= 1 <= high \(got 1.5, 5.0\)"),
    ({"icepop_high": 0.9}, r"--icepop-low and --icepop-high must satisfy 0 <= low <= 1 <= high \(got 0.5, 0.9\)"),
    ({"seq_mask_cap": 1.0}, r"--seq-mask-cap must be > 1 \(got 1.0\)"),
    ({"opsm_delta": -0.1}, r"--opsm-delta must be >= 0 \(got -0.1\)"),
    ({"cispo_eps_low": 1.5}, r"--cispo-eps-low must be in \[0, 1\] and --cispo-eps-high > 0 \(got 1.5, 0.28\)"),
    ({"cispo_eps_high": 0.0}, r"--cispo-eps-low must be in \[0, 1\] and --cispo-eps-high > 0 \(got 1.0, 0.0\)"),
])
def test_bad_input_is_refused_before_any_model_is_built(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(async_grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=message):
        async_grpo.main(small_args(tmp_path, **overrides))


GENERATOR_FAILS = """
import sys, time
sys.argv = ["async_grpo.py", *sys.argv[1:]]
import async_grpo
from common.cli import run
real = async_grpo.generate
def generate(model, tokenizer, task, args, index, version, *devices):
    if index == 3:
        open(sys.argv[-1] + ".failed_at", "w").write(repr(time.time()))
        raise ValueError("reward server unreachable")
    return real(model, tokenizer, task, args, index, version, *devices)
async_grpo.generate = generate
run(async_grpo.main, async_grpo.tyro.cli(async_grpo.Args))
"""


def test_a_generator_exception_ends_the_run_non_zero_within_10_seconds(tmp_path):
    out = run_script(sys.executable, "-c", GENERATOR_FAILS, "--steps", "50", "--eval-every", "0", "--prompts-per-step", "8",
                     "--output-dir", str(tmp_path), "--run-name", str(tmp_path / "run"), timeout=120)
    ended = time.time()
    assert out.returncode != 0
    assert "ValueError: reward server unreachable" in out.stderr and "the generation thread failed" in out.stderr
    assert ended - float((tmp_path / "run.failed_at").read_text()) < 10


def test_ctrl_c_stops_both_threads_checkpoints_and_exits_130(tmp_path):
    assert_ctrl_c_checkpoints_and_exits_130("async_grpo.py", tmp_path / "run")


def test_more_than_one_process_is_refused_in_one_line(tmp_path):
    out = launch_two_processes("async_grpo.py", "--steps", "1", "--device", "cpu", "--output-dir", str(tmp_path))
    assert out.returncode != 0 and "async_grpo.py: error: async_grpo.py runs as one process" in out.stderr


def test_behaviour_diagnostics_measure_the_tail_of_w_the_tokens_that_moved_and_the_positive_tokens_above_the_clip():
    """w = pi_old / mu per token, 200 tokens: 150 unmoved (w = 1), and 8 at 0.4, 10 each at 1.15, 1.25, 1.9, 7 at 2.1,
    3 at 2.5, 2 at 3.0. The 99th percentile is the 198th smallest, 2.5 (the 95th: 2.1, the largest: 3.0); 20 tokens
    moved by more than 2x (0.4, 2.1, 2.5, 3.0; not 1.9); of the 50 positive-advantage tokens (30 unmoved, the ten at
    1.15 and the ten at 1.25), 10 lie above 1.2."""
    values = [(1.0, 30, True), (1.0, 120, False), (0.4, 8, False), (1.15, 10, True), (1.25, 10, True), (1.9, 10, False),
              (2.1, 7, False), (2.5, 3, False), (3.0, 2, False)]  # (w, tokens, positive advantage)
    w = torch.tensor([v for v, n, _ in values for _ in range(n)])
    positive = torch.tensor([p for _, n, p in values for _ in range(n)])
    advantages = torch.where(positive, 0.8, -0.5)
    advantages[180:] = 1e-4  # rounding of a group of equal rewards: not positive
    behav = torch.linspace(-3.0, -0.5, 200)
    d = async_grpo.behaviour_diagnostics(behav + w.log(), behav, advantages)
    assert d["offpolicy/behaviour_ratio_p99"] == pytest.approx(2.5, rel=1e-5)
    assert d["offpolicy/moved_frac"] == pytest.approx(20 / 200)
    assert d["offpolicy/pos_above_1.2"] == pytest.approx(10 / 50)
    assert d["offpolicy/behaviour_kl"] == pytest.approx((w - 1 - w.log()).mean().item(), rel=1e-5)  # k3, samples of mu
    assert d["offpolicy/ess"] == pytest.approx((w.sum() ** 2 / (200 * (w**2).sum())).item(), rel=1e-5)
    on_policy = async_grpo.behaviour_diagnostics(behav, behav, advantages)
    assert (on_policy["offpolicy/moved_frac"], on_policy["offpolicy/pos_above_1.2"]) == (0.0, 0.0)
    assert on_policy["offpolicy/behaviour_ratio_p99"] == pytest.approx(1.0)
