"""ppo.py: GAE, value clipping, KL-in-reward placement, explained variance, and the script end to end."""


import pytest
import torch
from conftest import assert_runs_match, latest_weights, launch_two_processes, small_args, state_dicts_equal, without_timing

import ppo
from common.cli import ConfigError
from common.logging import read_metrics


def reference_gae(rewards, values, length, gamma, lam):
    """A straightforward loop over one completion's `length` real tokens; V after the last is 0."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_matches_a_reference_loop_with_masked_tails(gamma, lam):
    rewards = torch.tensor([[0.1, -0.2, 0.3, 1.0, 7.0], [0.0, 0.5, 9.0, 9.0, 9.0], [0.2, 0.2, 0.2, 0.2, -1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 0.2, 5.0], [0.1, 0.2, 8.0, 8.0, 8.0], [0.0, 0.1, 0.2, 0.3, 0.4]])
    lengths = [4, 2, 5]  # junk (7, 9, 8, 5) after each completion's end must not matter
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        expected = reference_gae(rewards[i].tolist(), values[i].tolist(), n, gamma, lam)
        assert advantages[i].tolist() == pytest.approx(expected, abs=1e-6)
        assert returns[i, :n].tolist() == pytest.approx([a + v for a, v in zip(expected[:n], values[i, :n].tolist())], abs=1e-6)
        assert returns[i, n:].abs().sum() == 0


def test_gae_with_lambda_one_and_gamma_one_is_the_return_minus_the_value():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.3, 0.6, 0.9]])
    advantages, _ = ppo.gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert advantages.tolist()[0] == pytest.approx([0.7, 0.4, 0.1])


def test_task_score_lands_on_the_last_real_token_only_and_kl_on_every_token():
    logps = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    ref_logps = torch.tensor([[-1.5, -1.5, -1.5, -1.5], [-2.0, -1.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = ppo.per_token_rewards(torch.tensor([1.0, 0.5]), logps, ref_logps, mask, kl_coef=0.1)
    assert rewards[0].tolist() == pytest.approx([-0.05, -0.05, -0.05 + 1.0, 0.0])
    assert rewards[1].tolist() == pytest.approx([0.0, 0.1 + 0.5, 0.0, 0.0])
    assert ppo.per_token_rewards(torch.tensor([1.0, 0.5]), logps, None, mask, 0.1)[1].tolist() == [0, 0.5, 0, 0]


def test_value_loss_is_clipped_around_the_old_values():
    args = ppo.Args(cliprange_value=0.2, vf_coef=1.0, ent_coef=0.0)
    zeros = torch.zeros(1, 3)
    values = torch.tensor([[1.0, 0.1, -0.5]])  # moved +1.0, +0.1, -0.5 from V_old = 0
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    _, stats = ppo.ppo_loss(zeros, zeros, values, zeros, zeros, returns, zeros, torch.ones(1, 3), args, 3)
    # token 1: max((1-2)^2, (0.2-2)^2) = 3.24; token 2: max(0.81, 0.81) = 0.81; token 3: max(0.25, (-0.2)^2) = 0.25
    assert stats["vf_loss"].item() == pytest.approx(0.5 * (3.24 + 0.81 + 0.25) / 3)
    assert stats["vf_clip"].item() == 2


def test_policy_loss_is_the_pessimistic_clipped_surrogate():
    args = ppo.Args(cliprange=0.2, vf_coef=0.0)
    old = torch.zeros(1, 2)
    logps = torch.log(torch.tensor([[1.5, 0.5]]))
    advantages = torch.tensor([[1.0, -1.0]])
    zeros = torch.zeros(1, 2)
    _, stats = ppo.ppo_loss(logps, old, zeros, zeros, advantages, zeros, zeros, torch.ones(1, 2), args, 2)
    # A=+1, r=1.5: max(-1.5, -1.2) = -1.2;  A=-1, r=0.5: max(0.5, 0.8) = 0.8
    assert stats["pg_loss"].item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1


def test_explained_variance_of_a_perfect_and_a_constant_critic():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


PPO_SMALL = dict(prompts_per_step=32, num_generations=1, minibatches=2, ppo_epochs=2)


def test_a_separate_critic_reads_its_values_off_its_last_hidden_state_without_its_output_layer():
    """--critic separate: V(s_t) = value_head(the critic's last hidden state at s_t). The critic's vocabulary logits
    (B x T x V, its forward's largest tensor) are not computed, and the values are what the critic's own forward gives."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2)
    policy, critic = LlamaForCausalLM(config), LlamaForCausalLM(config)
    model = ppo.ActorCritic(policy, critic)
    positions = []
    critic.get_output_embeddings().register_forward_hook(lambda module, x, out: positions.append(out.shape[1]))
    prompt_ids, completion_ids = torch.randint(0, 64, (4, 5)), torch.randint(0, 64, (4, 3))
    logits, values = model(prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))
    assert logits.shape == (4, 3, 64) and sum(positions) == 0  # the policy's logits; none through the critic's head
    hidden = critic(input_ids=torch.cat([prompt_ids, completion_ids], 1), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(values, model.value_head(hidden[:, 4:7]).squeeze(-1))  # the states before y_1..y_3


def test_ppo_smoke_run_with_a_value_head_logs_the_shared_and_ppo_metrics(tmp_path):
    ppo.main(small_args(ppo, tmp_path, steps=2, **PPO_SMALL))
    rows = read_metrics(tmp_path / "run")
    for key in ("value/loss", "value/explained_variance", "value/clip_frac", "policy/approx_kl", "policy/clip_frac_low",
                "policy/clip_frac_high", "objective/kl_ref", "objective/non_score_reward", "reward/mean", "eval/pass@1"):
        assert key in rows[2], key
    assert rows[1]["objective/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the first batch is sampled by pi_ref itself
    assert latest_weights(tmp_path / "run").num_parameters() > 0


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_ppo_resume_ends_like_an_uninterrupted_run(tmp_path, critic):
    """Bit for bit, by construction: the value head (and a separate critic) and the adaptive beta are in state.pt."""
    flags = dict(critic=critic, save_every=2, adaptive_kl_target=0.01, **PPO_SMALL)
    ppo.main(small_args(ppo, tmp_path / "full", steps=4, **flags))
    ppo.main(small_args(ppo, tmp_path / "cut", steps=2, **flags))
    ppo.main(small_args(ppo, tmp_path / "cut", steps=4, resume=str(tmp_path / "cut" / "run"), **flags))
    assert without_timing(read_metrics(tmp_path / "cut" / "run")) == without_timing(read_metrics(tmp_path / "full" / "run"))
    assert state_dicts_equal(latest_weights(tmp_path / "cut" / "run"), latest_weights(tmp_path / "full" / "run"))


def test_adaptive_kl_controller_raises_beta_when_kl_is_above_target(tmp_path):
    ppo.main(small_args(ppo, tmp_path, steps=3, adaptive_kl_target=1e-4, adaptive_kl_horizon=100, eval_every=0, **PPO_SMALL))
    rows = read_metrics(tmp_path / "run")[1:]
    # step 1 is sampled by pi_ref itself (KL 0): the error is clipped to -0.2, beta falls by 0.2 * 32 / 100
    assert rows[0]["objective/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 32 / 100))
    assert rows[-1]["objective/kl_coef"] > rows[-2]["objective/kl_coef"]


@pytest.mark.parametrize("overrides, message", [
    (dict(kl_coef=-0.1), "--kl-coef must be >= 0"),
    (dict(cliprange=1.5), "--cliprange must be in \\(0, 1\\)"),
    (dict(task="sort"), "--task 'sort' is not one of"),
    (dict(lam=1.5), "--gamma and --lam must be in \\[0, 1\\]"),
    (dict(minibatches=100), "--minibatches must be in \\[1, 32\\]"),
])
def test_ppo_refuses_bad_input_before_building_a_model(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(ppo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    args = {**PPO_SMALL, **overrides}
    with pytest.raises(ConfigError, match=message):
        ppo.main(small_args(ppo, tmp_path, **args))


def test_two_processes_give_the_same_run_as_one(tmp_path):
    """Prompts sharded, gradients averaged, the token means and the whitening of rewards and advantages over the global
    batch: two processes take one process's steps. One minibatch per epoch (each process shuffles its own rows, so
    several minibatches would group the rows otherwise)."""
    flags = dict(steps=2, prompts_per_step=16, num_generations=1, minibatches=1, ppo_epochs=2, whiten_rewards=True,
                 eval_every=1)
    argv = [x for k, v in flags.items() for x in ([f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)]))]
    out = launch_two_processes("ppo.py", *argv,
                               "--eval-prompts", "16", "--eval-samples", "4", "--eval-k", "2", "--device", "cpu",
                               "--output-dir", str(tmp_path / "two"), "--run-name", "run")
    assert out.returncode == 0, out.stderr[-3000:]
    ppo.main(small_args(ppo, tmp_path / "one", **flags))
    assert_runs_match(tmp_path / "one" / "run", tmp_path / "two" / "run")


# ---------------------------------------------------------------- what each PPO flag changes
def ppo_inputs(**overrides):
    """Two completions of 3 tokens, the second cut at the budget (no EOS), beta 0, V = 0."""
    args = ppo.Args(kl_coef=0.0, gamma=1.0, lam=1.0, **overrides)
    mask = torch.ones(2, 3)
    zeros = torch.zeros(2, 3)
    return dict(task_scores=torch.tensor([1.0, 0.5]), finished=torch.tensor([True, False]), old_logps=zeros, ref_logps=None,
                old_values=zeros, mask=mask, kl_coef=0.0, args=args)


def test_no_eos_penalty_replaces_the_score_of_a_completion_that_never_ended():
    _, returns = ppo.advantages_and_returns(**ppo_inputs(no_eos_penalty=-1.0))
    assert returns[:, 0].tolist() == [1.0, -1.0]  # gamma = lam = 1, V = 0: the return at t = 0 is the score
    _, returns = ppo.advantages_and_returns(**ppo_inputs(no_eos_penalty=None))
    assert returns[:, 0].tolist() == [1.0, 0.5]


def test_whiten_rewards_scales_the_per_token_rewards_to_unit_std_keeping_their_mean():
    inputs = ppo_inputs(no_eos_penalty=None, whiten_rewards=True)
    _, returns = ppo.advantages_and_returns(**inputs)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5]])  # the scores at the last tokens
    whitened = (rewards - rewards.mean()) / rewards.std() + rewards.mean()
    assert returns[:, 0].tolist() == pytest.approx(whitened.sum(-1).tolist(), rel=1e-5)


def test_the_entropy_bonus_subtracts_ent_coef_times_the_mean_entropy():
    zeros, entropy = torch.zeros(1, 2), torch.tensor([[0.6, 1.0]])
    inputs = (zeros, zeros, zeros, zeros, zeros, zeros, entropy, torch.ones(1, 2))
    without, _ = ppo.ppo_loss(*inputs, ppo.Args(ent_coef=0.0), 2)
    with_bonus, _ = ppo.ppo_loss(*inputs, ppo.Args(ent_coef=0.5), 2)
    assert (with_bonus - without).item() == pytest.approx(-0.5 * 0.8)


def test_target_kl_stops_the_epochs_once_the_approximate_kl_passes_it(tmp_path):
    """The first epoch's second minibatch is off-policy (r != 1), so its approximate KL is > 0 > 1e-12: one epoch of 4."""
    ppo.main(small_args(ppo, tmp_path, steps=1, eval_every=0, target_kl=1e-12, **{**PPO_SMALL, "ppo_epochs": 4}))
    assert read_metrics(tmp_path / "run")[1]["policy/epochs"] == 1.0
