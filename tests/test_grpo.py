"""grpo.py: the objective on hand-made inputs, and the script end to end on the embedded job."""

import json
import signal
import sys

import conftest
import pytest
import torch
from conftest import (CHAT_TEMPLATE, assert_ctrl_c_checkpoints_and_exits_130, assert_runs_match, latest_weights,
                      launch_two_processes, run_script, state_dicts_equal, without_timing)

import grpo
from common.cli import ConfigError
from common.logging import read_metrics
from common.losses import aggregate, group_advantages
from common.rollout import rollout, token_logprobs


def small_args(tmp_path, **overrides) -> grpo.Args:
    return conftest.small_args(grpo, tmp_path, **overrides)


ONE_STEP = dict(steps=1, eval_every=0)


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """Step 1 of the default small run (several tests compare a flag's step 1 with it): its metrics row and run dir."""
    tmp = tmp_path_factory.mktemp("one_step")
    grpo.main(small_args(tmp, **ONE_STEP))
    return read_metrics(tmp / "run")[1], tmp / "run"


# ---------------------------------------------------------------- the objective
def test_clipped_surrogate_on_hand_made_ratios():
    args = grpo.Args(eps_low=0.2, eps_high=0.28, beta=0.0, loss_agg="token-mean", max_new_tokens=4)
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]]))  # ratios, since old log-probs are 0
    mask = torch.ones(1, 4)
    loss, stats = grpo.grpo_loss(logps, old, None, torch.tensor([1.0]), mask, args, 1, 4)
    # A = +1: min(r, clip(r)) = 1.28, 0.5, 1.1, 0.9 -> loss = -mean
    assert loss.item() == pytest.approx(-(1.28 + 0.5 + 1.1 + 0.9) / 4)
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 0
    loss, stats = grpo.grpo_loss(logps, old, None, torch.tensor([-1.0]), mask, args, 1, 4)
    # A = -1: min(-r, -clip(r)) = -1.5, -0.8, -1.1, -0.9 -> loss = mean of r-ish terms
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1 + 0.9) / 4)
    assert stats["clip_low"].item() == 1 and stats["clip_high"].item() == 0


def test_kl_term_adds_beta_times_k3():
    args = grpo.Args(beta=0.5, loss_agg="token-mean", max_new_tokens=1)
    logps, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    loss, _ = grpo.grpo_loss(logps, logps, ref, torch.tensor([0.0]), torch.ones(1, 1), args, 1, 1)
    assert loss.item() == pytest.approx(0.5 * (0.5 - torch.log(torch.tensor(0.5)).item() - 1))


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_grpo_gradient_at_ratio_one_without_kl_is_reinforce_with_a_group_baseline(tiny_model, tokenizer, loss_agg):
    """At pi_theta == pi_old and beta = 0, grad of the clipped objective = grad of agg(A_i log pi(y_it))."""
    prompts = [p for p in ["12>", "345>"] for _ in range(4)]
    batch = rollout(tiny_model, tokenizer, prompts, [(0, i) for i in range(8)], 6, 1.0, [tokenizer.eos_token_id], "cpu")
    advantages = group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1]), 4)
    args = grpo.Args(beta=0.0, loss_agg=loss_agg, max_new_tokens=6)
    params = [p for p in tiny_model.parameters()]

    def grad_of(loss_fn):
        logps, _ = token_logprobs(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                  batch.completion_mask, 1.0)
        return torch.autograd.grad(loss_fn(logps), params)

    grpo_grad = grad_of(lambda lp: grpo.grpo_loss(lp, lp.detach(), None, advantages, batch.completion_mask, args, 8, None)[0])
    reinforce = grad_of(lambda lp: -aggregate(advantages[:, None] * lp, batch.completion_mask, loss_agg, max_len=6))
    for a, b in zip(grpo_grad, reinforce):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in grpo_grad)


# ---------------------------------------------------------------- bad input
BAD_INPUT = [
    (dict(num_generations=1), "--num-generations must be at least 2"),
    (dict(beta=-0.1), "--beta must be >= 0"),
    (dict(task="sort"), "--task 'sort' is not one of"),
    (dict(task="gsm8k", data_path="missing.jsonl"), "--data-path missing.jsonl: no such file"),
    (dict(eps_low=1.0), "--eps-low must be in \\(0, 1\\)"),
    (dict(eps_low=0.0), "--eps-low must be in \\(0, 1\\)"),
    (dict(prompts_per_step=0), "--prompts-per-step"),
    (dict(eval_k=16, eval_samples=8), "--eval-k must be in"),
    (dict(dynamic_sampling=True, train_size=8), "--dynamic-sampling needs more training prompts than --prompts-per-step"),
    (dict(extra_eval_data_path=["missing.jsonl"]), "--extra-eval-data-path missing.jsonl: no such file"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUT)
def test_bad_input_is_refused_before_any_model_is_built(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=message):
        grpo.main(small_args(tmp_path, **overrides))


def test_a_data_file_without_the_needed_fields_names_the_row(tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "result": 4}\n')
    with pytest.raises(ConfigError, match=r"data.jsonl row 1: field 'answer'"):
        grpo.main(small_args(tmp_path, task="gsm8k", model="unused", data_path=str(path)))


def test_command_line_error_is_one_line_and_exits_2():
    for flags, message in ((["--num-generations", "1"], "--num-generations must be at least 2"),
                           (["--beta", "-0.5"], "--beta must be >= 0")):
        out = run_script(sys.executable, "grpo.py", *flags, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("grpo.py: error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize("flags", [[], ["--gradient-checkpointing"]])
def test_a_first_run_prints_no_warning(tmp_path, flags):
    """What a new user reads first: no deprecation or future warning from the installed transformers (5.25 renamed
    gradient checkpointing to activation checkpointing and warns on the old names)."""
    out = run_script(sys.executable, "grpo.py", "--steps", "1", "--eval-prompts", "4", "--output-dir", str(tmp_path), *flags)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "warn" not in out.stderr, out.stderr


# ---------------------------------------------------------------- the script end to end
def test_smoke_run_writes_metrics_args_and_a_loadable_checkpoint_and_prints_a_summary(tmp_path, capsys):
    grpo.main(small_args(tmp_path, steps=2, eval_k=1))
    run_dir = tmp_path / "run"
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(summary) == 2 and all(line.count("eval/pass@") == 1 for line in summary)  # pass@k only when k > 1
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "eval/pass@1", "eval/pass@1_se", "eval/pass@k", "eval/greedy", "eval/greedy_se",
                            "eval/reward_mean", "eval/mean_length", "time/eval_s"}
    for key in ("reward/mean", "reward/std", "accuracy/train", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_frac", "policy/entropy", "policy/approx_kl", "policy/clip_frac_low",
                "policy/clip_frac_high", "policy/ratio_mean", "policy/ratio_min", "policy/ratio_max",
                "policy/kl_ref", "policy/grad_norm", "time/rollout_s", "time/train_s",
                "throughput/tokens_per_s", "throughput/samples_per_s", "eval/pass@1"):
        assert key in rows[2], key
    assert json.loads((run_dir / "args.json").read_text())["max_new_tokens"] == 8
    assert latest_weights(run_dir).num_parameters() > 0
    assert torch.load(run_dir / "checkpoints" / "step_000002" / "state.pt", weights_only=True)["step"] == 2


def test_several_passes_over_a_batch_make_clipping_bind(tmp_path):
    grpo.main(small_args(tmp_path, steps=2, num_iterations=2, prompts_per_step=16, eval_every=0))
    rows = read_metrics(tmp_path / "run")[1:]
    assert all(r["policy/clip_frac_low"] + r["policy/clip_frac_high"] > 0 for r in rows)
    assert all(r["policy/ratio_max"] > 1.0 for r in rows)


def test_minibatches_accumulate_to_the_same_update(tmp_path, one_step):
    """The loss of each micro-batch is normalised by the whole batch's counts, so four micro-batches take the step one
    batch takes: the same gradient (its norm, to rounding). (The loss itself is ~0 at ratio 1: the advantages of a group
    sum to 0.) Adam's first step moves every weight by about lr = 5e-4; split and unsplit agree to 10 % of that (the
    summation order differs, and Adam's g / sqrt(v) amplifies it on weights whose gradient is near zero: measured on
    one machine, 1 weight of 4096 in one matrix differed by 1.9e-5, the rest by < 1.2e-6)."""
    a, a_dir = one_step
    grpo.main(small_args(tmp_path, minibatches=4, **ONE_STEP))
    b = read_metrics(tmp_path / "run")[1]
    for key in ("policy/grad_norm", "policy/entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert state_dicts_equal(latest_weights(a_dir), latest_weights(tmp_path / "run"), atol=5e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the checkpoint's float32 master weights make it exact
def test_resumed_run_ends_like_an_uninterrupted_one(tmp_path, dtype):
    """Bit for bit, by construction: the checkpoint holds the float32 weights, AdamW's state and the RNG states, and
    step t's prompts and noise depend only on (seed, t), so the resumed process runs the same kernels on the same
    numbers as the uninterrupted one."""
    grpo.main(small_args(tmp_path / "full", steps=4, save_every=2, dtype=dtype))
    grpo.main(small_args(tmp_path / "cut", steps=2, save_every=2, dtype=dtype))
    (tmp_path / "cut" / "run" / "metrics.jsonl").open("a").write('{"step": 3, "logged": "after the checkpoint"}\n')
    grpo.main(small_args(tmp_path / "cut", steps=4, save_every=2, resume=str(tmp_path / "cut" / "run"), dtype=dtype))
    full, resumed = tmp_path / "full" / "run", tmp_path / "cut" / "run"
    assert without_timing(read_metrics(resumed)) == without_timing(read_metrics(full))
    assert state_dicts_equal(latest_weights(resumed), latest_weights(full))


def test_resume_refuses_a_changed_algorithm_flag(tmp_path, one_step):
    _, run_dir = one_step
    with pytest.raises(ConfigError, match="--lr is 0.5 but the run being resumed used 0.0005"):
        grpo.main(small_args(run_dir.parent, lr=0.5, resume=str(run_dir), **{**ONE_STEP, "steps": 2}))


def test_sigterm_checkpoints_the_last_completed_step_and_exits_non_zero(tmp_path):
    """What a cluster's scheduler sends before it kills a job (Ctrl-C, SIGINT, is tested on async_grpo.py)."""
    assert_ctrl_c_checkpoints_and_exits_130("grpo.py", tmp_path / "run", sig=signal.SIGTERM)


def test_two_processes_give_the_same_run_as_one(tmp_path):
    """Two processes: prompts sharded, gradients averaged, losses normalised by
    global counts, so the metrics and weights after two steps match a single-process run."""
    flags = ["--steps", "2", "--prompts-per-step", "8", "--num-generations", "4", "--eval-prompts", "16",
             "--eval-samples", "4", "--eval-k", "2", "--eval-every", "1", "--loss-agg", "token-mean", "--device", "cpu"]
    out = launch_two_processes("grpo.py", *flags, "--output-dir", str(tmp_path / "two"), "--run-name", "run")
    assert out.returncode == 0, out.stderr[-3000:]
    grpo.main(small_args(tmp_path / "one", steps=2, eval_every=1, loss_agg="token-mean"))
    assert_runs_match(tmp_path / "one" / "run", tmp_path / "two" / "run")


def test_real_model_path_on_a_local_model_with_a_chat_template_and_a_local_gsm8k_file(tmp_path, tiny_model, tokenizer):
    """The --model <dir> --task gsm8k --data-path route, offline: a local model directory whose
    tokenizer has a chat template, and a GSM8K-format jsonl file."""
    model_dir = tmp_path / "local-model"
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tokenizer.chat_template = None
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                            for i in range(12)))
    grpo.main(small_args(tmp_path, task="gsm8k", model=str(model_dir), data_path=str(data), steps=1,
                         max_new_tokens=6, eval_prompts=4))
    rows = read_metrics(tmp_path / "run")
    assert rows[1]["completions/mean_length"] <= 6 and 0.0 <= rows[1]["reward/mean"] <= 1.0
    args = json.loads((tmp_path / "run" / "args.json").read_text())
    assert args["model"] == str(model_dir) and args["task"] == "gsm8k"


# ---------------------------------------------------------------- DAPO's dynamic sampling
def test_dynamic_sampling_trains_only_on_groups_with_signal(tmp_path):
    grpo.main(small_args(tmp_path, steps=3, eval_every=0, dynamic_sampling=True, max_sampling_rounds=6))
    rows = read_metrics(tmp_path / "run")[1:]
    assert all(r["frac_reward_zero_std"] == 0.0 for r in rows)  # every trained group has rewards that differ
    assert all(r["sampling/rounds"] >= 2 and r["sampling/dropped_groups"] > 0 for r in rows)  # the base model solves some


def test_dynamic_sampling_at_its_cap_fills_the_batch_with_all_equal_groups(tmp_path, one_step):
    """One round only: nothing can be redrawn, so the all-equal groups stay and the step is plain GRPO's batch,
    reordered (groups with signal first): the same loss and gradient up to float rounding."""
    grpo.main(small_args(tmp_path, dynamic_sampling=True, max_sampling_rounds=1, **ONE_STEP))
    dyn, plain = read_metrics(tmp_path / "run")[1], one_step[0]
    assert dyn["sampling/dropped_groups"] == 0.0 and dyn["sampling/rounds"] == 1.0
    assert dyn["reward/mean"] == plain["reward/mean"] and dyn["frac_reward_zero_std"] == plain["frac_reward_zero_std"] > 0
    for key in ("policy/grad_norm", "policy/entropy"):  # (the loss is ~0 and kl_ref 0 at ratio 1: nothing to compare)
        assert dyn[key] == pytest.approx(plain[key], rel=1e-5), key


def test_dynamic_sampling_refills_from_the_prompts_that_remain_and_counts_the_rounds_it_drew(tmp_path, monkeypatch):
    """A pool of 12 prompts and 8 a step: a second round draws the 4 prompts left (16 completions), and then none is left."""
    drawn, real = [], grpo.rollout

    def counted(model, tokenizer, prompts, *args, **kwargs):
        drawn.append(len(prompts))
        return real(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(grpo, "rollout", counted)
    grpo.main(small_args(tmp_path, steps=3, eval_every=0, train_size=12, dynamic_sampling=True, max_sampling_rounds=4))
    rows = read_metrics(tmp_path / "run")[1:]
    assert sum(r["sampling/rounds"] for r in rows) == len(drawn)  # the rounds reported are the rounds drawn
    assert max(r["sampling/rounds"] for r in rows) == 2 and sorted(set(drawn)) == [16, 32]


# ---------------------------------------------------------------- what each sampling and objective flag changes
def test_scale_rewards_none_leaves_the_centred_rewards_undivided(tmp_path, one_step):
    """Dr. GRPO: A = R - mean, not (R - mean) / std; with 0/1 rewards std < 1, so the same batch gives a smaller gradient."""
    grpo.main(small_args(tmp_path, scale_rewards="none", **ONE_STEP))
    none, group = read_metrics(tmp_path / "run")[1], one_step[0]
    assert none["reward/mean"] == group["reward/mean"]  # the same batch
    assert none["policy/grad_norm"] < 0.8 * group["policy/grad_norm"]


def test_a_lower_temperature_samples_and_scores_a_sharper_distribution(tmp_path, one_step):
    grpo.main(small_args(tmp_path, temperature=0.5, **ONE_STEP))
    cold, warm = read_metrics(tmp_path / "run")[1], one_step[0]
    assert cold["policy/entropy"] < 0.9 * warm["policy/entropy"]  # entropy of softmax(logits / T), the sampled one
    assert cold["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # the training forward divides by T too


def test_the_kl_estimator_flag_reaches_the_loss_and_the_log(tmp_path, monkeypatch):
    used, kl_estimate = [], grpo.kl_estimate
    monkeypatch.setattr(grpo, "kl_estimate", lambda p, q, estimator="k3": (used.append(estimator), kl_estimate(p, q, estimator))[1])
    grpo.main(small_args(tmp_path, kl_estimator="k2", **ONE_STEP))
    assert used.count("k2") == 2 and set(used) == {"k2", "k3"}  # the penalty and the logged kl_ref; approx_kl is k3


def test_generation_batch_size_samples_and_evaluates_that_many_rows_at_a_time(tmp_path, monkeypatch):
    import common.rollout

    rows, sample = [], common.rollout.sample
    monkeypatch.setattr(common.rollout, "sample", lambda model, ids, *a, **k: (rows.append(len(ids)), sample(model, ids, *a, **k))[1])
    grpo.main(small_args(tmp_path, generation_batch_size=5, steps=1))
    assert rows[:2] == [4, 4]  # load_policy's check_forward samples 4 rows of its own first, twice (copies, prompt once)
    assert max(rows[2:]) == 5 and sum(rows[2:]) == 8 * 4 + 16 * 4 * 2 + 16 * 2  # step 1 + two evals (sampled, and greedy)
