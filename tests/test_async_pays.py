"""repro/real_model_async_pays.py's model: where a run reaches an accuracy (linear between evaluations), and what a
step costs on one device (S + L) against one generator and one learner device (max(S, L) + the weight push)."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "repro"))
from real_model_async_pays import crossing, mean_efficiency, passes_of, pays_for, seconds_to, share, step_efficiency  # noqa: E402


def test_crossing_is_linear_between_evaluations():
    points = [(0, 0.10), (20, 0.20), (40, 0.30)]
    assert crossing(points, 0.15) == pytest.approx(10.0)
    assert crossing(points, 0.25) == pytest.approx(30.0)
    assert crossing(points, 0.05) == 0.0  # already there at the start
    assert crossing(points, 0.35) is None  # never
    assert crossing([(0, 0.1), (20, 0.3), (40, 0.2)], 0.25) == pytest.approx(15.0)  # the first time, not the last


def test_a_step_costs_s_plus_l_synchronously_and_the_larger_share_plus_the_push_asynchronously():
    rows = [{"step": t, "time/rollout_s": 4.0, "time/train_s": 6.0} for t in (1, 2, 3)]  # T = 10 s a step, f = 0.4
    assert share(rows) == pytest.approx(0.4)
    assert seconds_to(rows, 2.0, 0.4, 0, push=0.5) == pytest.approx(20.0)  # K = 0: sample, then train
    assert seconds_to(rows, 2.0, 0.4, 4, push=0.5) == pytest.approx(2 * (6.0 + 0.5))  # overlapped: max(4, 6) + push
    assert seconds_to(rows, 2.0, 0.8, 4, push=0.0) == pytest.approx(16.0)  # the share is the model's parameter
    assert seconds_to(rows, 1.5, 0.5, 4, push=0.0) == pytest.approx(7.5)  # a fractional step: linear inside it


def test_an_arm_that_trains_each_batch_n_times_costs_its_learner_n_passes():
    """K4_none_2iter trains each batch twice: with f = S / (S + L) the share of a one-pass step, its step costs S + n L
    on one device and max(S, n L) + P overlapped. At f = 0.5 and n = 2 overlap hides a third of its step, not a half."""
    rows = [{"step": t, "time/rollout_s": 4.0, "time/train_s": 8.0} for t in (1, 2)]  # S = 4, n L = 8: T = 12
    assert seconds_to(rows, 2.0, 0.5, 4, push=0.0, passes=2) == pytest.approx(2 * 8.0)  # max(4, 2 x 4)
    assert seconds_to(rows, 2.0, 0.5, 4, push=0.0) == pytest.approx(2 * 6.0)  # one pass: max(f, 1 - f) T
    assert seconds_to(rows, 2.0, 0.5, 0, push=0.0, passes=2) == pytest.approx(24.0)  # K = 0: sample, then train
    assert passes_of("K4_none_2iter") == 2 and passes_of("K4_none") == 1 and passes_of("K0") == 1


def test_async_pays_at_the_shares_where_both_phases_of_a_stale_step_are_shorter_than_what_it_is_worth():
    """Async at efficiency e pays iff e > max(f, n (1 - f)) (P small): f < e and f > 1 - e / n. One pass: (1 - e, e),
    empty up to e = 0.5; two passes: (1 - e / 2, e), empty up to e = 2/3 (the learner's two passes are the longer phase)."""
    assert pays_for(0.8, 1) == (pytest.approx(0.2), pytest.approx(0.8))
    assert pays_for(0.8, 2) == (pytest.approx(0.6), pytest.approx(0.8))
    assert pays_for(0.5, 1) is None and pays_for(0.6, 2) is None and pays_for(0.67, 2) is not None


def test_step_efficiency_is_the_share_of_k0s_steps_a_stale_step_is_worth():
    k0 = [(0, 0.10), (20, 0.20), (40, 0.30)]
    assert step_efficiency(k0, (40, 0.20)) == pytest.approx(0.5)  # K = 0 got there in 20 steps, the stale run in 40
    assert step_efficiency(k0, (40, 0.05)) == pytest.approx(0.0)  # a collapse below the base model: worth nothing, not "pays"
    assert step_efficiency(k0, (40, 0.35)) == float("inf")  # beyond K = 0's reach


def test_a_seed_beyond_k0s_reach_makes_the_mean_efficiency_a_lower_bound():
    """K = 0 never reached seed 1's final accuracy in its 40 evaluated steps and the stale run took 40: that seed's e is
    at least 40 / 40, so the mean over seeds is at least (0 + 1) / 2, not an average with infinity."""
    assert mean_efficiency([0.0, float("inf")], [1.0, 1.0]) == (pytest.approx(0.5), True)
    assert mean_efficiency([0.5, 0.7], [1.0, 1.0]) == (pytest.approx(0.6), False)
