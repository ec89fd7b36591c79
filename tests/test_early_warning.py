"""repro/early_warning_across.py's rules: when a run is in trouble (held-out accuracy against its K = 0 run), where a
diagnostic's threshold lies (its healthy runs' extreme), and what counts as a warning, a lead and a false alarm."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "repro"))
from early_warning_across import Run, real_runs, score, series, trouble_step  # noqa: E402

KL = "offpolicy/behaviour_kl"


def rows(kl: list[float], pass1: dict[int, float], se: float = 0.01) -> list[dict]:
    """A run's log: one trained row a step with the given behaviour KL, evaluations at the given steps."""
    trained = [{"step": i + 1, "loss": 0.0, KL: v, "policy/grad_norm": 1.0} for i, v in enumerate(kl)]
    evaluated = [{"step": s, "eval/pass@1": p, "eval/pass@1_se": se} for s, p in pass1.items()]
    return sorted(trained + evaluated, key=lambda r: r["step"])


K0 = Run("real", "K0_s0", 0, 0, rows([0.0] * 40, {0: 0.1, 20: 0.3, 40: 0.4}))


def stale(name: str, kl: list[float], pass1: dict[int, float]) -> Run:
    return Run("real", name, 4, 0, rows(kl, pass1), K0)


def test_a_run_is_in_trouble_from_the_first_evaluation_that_stays_two_standard_errors_below_k0():
    # se of the difference: 0.01 * sqrt(2) = 0.014; two of them 0.028
    assert trouble_step(stale("both", [0.0] * 40, {0: 0.1, 20: 0.25, 40: 0.3})) == 20
    assert trouble_step(stale("late", [0.0] * 40, {0: 0.1, 20: 0.29, 40: 0.3})) == 40
    assert trouble_step(stale("recovers", [0.0] * 40, {0: 0.1, 20: 0.2, 40: 0.39})) is None
    assert trouble_step(stale("within 2 se", [0.0] * 40, {0: 0.1, 20: 0.28, 40: 0.38})) is None
    assert trouble_step(K0) is None  # K = 0 is the reference: healthy by definition


def test_series_is_smoothed_over_five_steps_and_starts_at_step_2():
    steps, values = series(rows([0.0, 0.0, 0.0, 0.0, 5.0, 0.0], {}), KL)
    assert steps == [2, 3, 4, 5, 6]
    assert values == pytest.approx([0.0, 0.0, 0.0, 1.0, 1.0])
    assert series(rows([0.0] * 3, {}), "offpolicy/moved_frac") is None  # a stale run that did not log it
    grpo = [{"step": 1, "loss": 0.0}, {"step": 2, "loss": 0.0}]
    assert series(grpo, "offpolicy/ess") == ([2], [1.0])  # grpo.py logs no behaviour metric: w = 1


def test_lead_is_the_trouble_evaluation_minus_the_first_crossing_and_false_alarms_leave_one_out():
    healthy = [stale("h1", [0.01] * 40, {0: 0.1, 20: 0.3, 40: 0.4}), stale("h2", [0.02] * 40, {0: 0.1, 20: 0.3, 40: 0.4})]
    early = stale("early", [0.0] * 4 + [0.2] * 36, {0: 0.1, 20: 0.1, 40: 0.1})  # smoothed 0.04 at step 5: crosses 0.02
    late = stale("late", [0.0] * 30 + [0.1] * 10, {0: 0.1, 20: 0.1, 40: 0.1})  # crosses after its trouble at 20
    result = score(KL, +1, [early, late], [K0, *healthy])
    assert result["threshold"] == pytest.approx(0.02)  # the healthy stale runs' largest: K = 0's constant 0 ignored
    assert result["leads"] == [15, None]
    # h2 against h1's 0.01 crosses; h1 against h2's 0.02 does not; K0 is not judged on a behaviour metric
    assert (result["alarms"], result["judged"]) == (1, 2)
    fixed = score(KL, +1, [early, late], [K0, *healthy], fixed=0.05)
    assert fixed["threshold"] == 0.05 and fixed["leads"] == [14, None]  # smoothed 0.04 at step 5, 0.08 at step 6
    assert (fixed["alarms"], fixed["judged"]) == (0, 2)


def test_without_a_healthy_stale_run_a_behaviour_metric_has_no_threshold():
    troubled = stale("t", [0.1] * 40, {0: 0.1, 20: 0.1, 40: 0.1})
    result = score(KL, +1, [troubled], [K0])  # K = 0's constant KL of 0 would make any staleness a "warning"
    assert result["threshold"] is None and result["leads"] == [] and result["judged"] == 0
    grad = score("policy/grad_norm", +1, [troubled], [K0])  # not a behaviour metric: K = 0 sets its threshold
    assert grad["threshold"] == pytest.approx(1.0) and grad["judged"] == 0  # leave-one-out of the only run: none left


def test_a_real_run_left_out_by_name_is_neither_labelled_nor_thresholded():
    every = {r.name for r in real_runs()}
    assert "K4_tis_cap3_s0" in every
    assert {r.name for r in real_runs(("K4_tis_cap3_s0",))} == every - {"K4_tis_cap3_s0"}
