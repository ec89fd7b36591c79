"""The 2025-26 fixes beside the methods they repair: GSPO's sequence ratio (grpo.py --importance-level, shared with
gapo.py), verl's sequence-level corrections and VCPO (async_grpo.py --correction seq-tis / seq-mis / vcpo), VC-PPO's
decoupled GAE and value warm-up (ppo.py --critic-lam / --value-warmup-steps): each on known numbers, micro-batched
against one batch, refused in one line where its value is out of range (tests/test_learning.py: 30 steps learn)."""

import math

import pytest
import torch
from conftest import small_args, state_dicts_equal
from test_async_grpo import loss_args
from test_corrections import MASK, W, A as A2, N, batch, loss_of

import async_grpo
import grpo
import ppo
from common.cli import ConfigError
from common.logging import read_metrics
from common.losses import importance_ratio

# ---------------------------------------------------------------- GSPO: the sequence ratio
# Two completions, after a first pass moved pi_theta: log(pi_theta / pi_old) of row 0's two tokens (and a pad), of row 1's
# three. Row 0: mean 0.1, s_0 = exp(0.1) = 1.105; row 1: mean -0.1, s_1 = exp(-0.1) = 0.905.
LOG_R = torch.tensor([[0.2, 0.0, 9.0], [0.1, -0.4, 0.0]])
RMASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def ratios(level):
    old = torch.log(torch.tensor([[0.3, 0.5, 0.5], [0.2, 0.4, 0.6]]))
    logps = (old + LOG_R).requires_grad_()
    return logps, old, importance_ratio(logps, old, RMASK, level)


def test_the_sequence_ratio_is_the_geometric_mean_of_the_token_ratios_on_every_token_of_its_sequence():
    _, _, token = ratios("token")
    logps, _, s = ratios("sequence")
    assert torch.allclose(token, torch.exp(LOG_R))
    assert s[0, :2].tolist() == pytest.approx([math.exp(0.1)] * 2) and s[1].tolist() == pytest.approx([math.exp(-0.1)] * 3)
    (grad,) = torch.autograd.grad((s * RMASK)[1, 0], logps)  # d s_1 / d log pi_theta(y_1t) = s_1 / |y_1|, every t
    assert (grad[1] * RMASK[1]).tolist() == pytest.approx([math.exp(-0.1) / 3] * 3) and grad[0].abs().sum() == 0


def test_gspo_token_has_the_sequence_ratios_value_and_each_tokens_own_gradient():
    logps, _, s = ratios("sequence-token")
    assert s[1].tolist() == pytest.approx([math.exp(-0.1)] * 3)
    (grad,) = torch.autograd.grad(s[1, 0], logps)  # sg(s_1) pi(y_10) / sg(pi(y_10)): s_1 on its own token only
    assert grad[1].tolist() == pytest.approx([math.exp(-0.1), 0.0, 0.0]) and grad[0].abs().sum() == 0


@pytest.mark.parametrize("level", ["sequence", "sequence-token"])
def test_gspo_clips_the_sequence_ratio_at_its_own_range(level):
    """A = +1 for both rows, GSPO's clip (3e-4, 4e-4): s_0 = 1.105 > 1.0004 is clipped (no gradient); s_1 = 0.905 is
    below 1 - 3e-4 with A > 0, where min() keeps it. seq-mean-token-mean, beta 0: loss = -(1.0004 + 0.905) / 2, and row
    1's gradient -s_1 / 6 on each of its tokens (1/2 a sequence, 1/3 a token)."""
    logps, old, _ = ratios(level)
    args = grpo.Args(importance_level=level, beta=0.0, max_new_tokens=3)
    assert (args.eps_low, args.eps_high) == (3e-4, 4e-4)
    loss, stats = grpo.grpo_loss(logps, old, None, torch.tensor([1.0, 1.0]), RMASK, args, 2, RMASK.sum())
    assert loss.item() == pytest.approx(-(1.0004 + math.exp(-0.1)) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad * RMASK).flatten().tolist() == pytest.approx([0.0] * 3 + [-math.exp(-0.1) / 6] * 3, abs=1e-7)
    assert stats["clip_high"].item() == 2  # row 0's two tokens


def test_gapo_reads_the_same_sequence_ratio(monkeypatch):
    import gapo

    seen = []
    real = gapo.importance_ratio
    monkeypatch.setattr(gapo, "importance_ratio", lambda *a: seen.append(a[3]) or real(*a))
    logps, old, _ = ratios("sequence")
    args = gapo.Args(ratio_level="sequence", eps_low=3e-3, eps_high_max=5e-3, beta=0.0, max_new_tokens=3)
    gapo.gapo_loss(logps, old, None, torch.tensor([1.0, 1.0]), torch.tensor([0.005, 0.005]), torch.tensor([1, 1]), RMASK,
                   args, 2, RMASK.sum())
    assert seen == ["sequence"]


def micro_batches_take_the_one_batch_step(script, tmp_path, keys, **flags) -> list[dict]:
    """Runs the script on one batch and in four micro-batches of whole groups; each step's `keys` agree. The one
    batch's rows."""
    script.main(small_args(script, tmp_path / "one", **flags))
    script.main(small_args(script, tmp_path / "micro", minibatches=4, **flags))
    one, micro = read_metrics(tmp_path / "one" / "run")[1:], read_metrics(tmp_path / "micro" / "run")[1:]
    assert len(one) == len(micro) == flags["steps"]
    for a, b in zip(one, micro):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    return one


@pytest.mark.parametrize("level", ["sequence", "sequence-token"])
def test_gspo_micro_batches_take_the_one_batch_step(tmp_path, level):
    """Two passes a batch (the second moves s_i): four micro-batches of whole groups take the one batch's steps."""
    one = micro_batches_take_the_one_batch_step(grpo, tmp_path, ("loss", "policy/grad_norm", "policy/ratio_max",
                                                                  "policy/clip_frac_high"),
                                                steps=2, eval_every=0, num_iterations=2, importance_level=level)
    assert one[-1]["policy/ratio_max"] != 1.0


def test_an_unknown_importance_level_is_refused_in_one_line():
    from conftest import run_script
    import sys

    out = run_script(sys.executable, "grpo.py", "--importance-level", "sentence")
    assert out.returncode == 2 and "--importance-level" in out.stderr


# ---------------------------------------------------------------- seq-tis, seq-mis: the sequence weight W = prod_t w_t
# test_corrections' batch: row 0's weights 0.4, 1.1, 6 (A = +1), row 1's 1.0, 0.8 (A = -1): W = 2.64 and 0.8.
def test_seq_tis_truncates_the_product_of_a_sequences_weights_on_every_token():
    """C = 2: row 0's W = 2.64 is truncated to 2 on its three tokens, row 1's 0.8 kept; first pass, u = 1."""
    loss, grad, stats = loss_of("seq-tis", seq_cap=2.0)
    assert loss == pytest.approx(-(2.0 * 3 - 0.8 * 2) / N)
    assert grad == pytest.approx([-2.0 / N] * 3 + [0.8 / N] * 2 + [0.0])
    assert stats["capped"].item() == 3 and stats["masked"].item() == 0


def test_seq_mis_drops_a_sequence_whose_weight_leaves_its_band_and_trains_the_rest_unweighted():
    loss, grad, stats = loss_of("seq-mis", seq_cap=2.0)
    assert loss == pytest.approx(-(-1 - 1) / N)
    assert grad == pytest.approx([0.0] * 3 + [1.0 / N] * 2 + [0.0])
    assert stats["masked"].item() == 3 and stats["masked_seqs"].item() == 1
    assert loss_of("seq-mis", seq_cap=3.0)[2]["masked"].item() == 0  # W = 2.64 < 3, 0.8 > 1/3: nothing dropped
    _, grad, stats = loss_of("seq-mis", seq_cap=1.2)  # verl's lower bound 1/C: 0.8 < 1/1.2 drops row 1 too
    assert stats["masked_seqs"].item() == 2 and grad == pytest.approx([0.0] * 6)


def test_the_vcpo_loss_weights_each_sequence_by_its_truncated_weight_and_clips_no_ratio():
    loss, grad, stats = loss_of("vcpo")  # C' = 8: neither weight truncated
    assert loss == pytest.approx(-(2.64 * 3 - 0.8 * 2) / N)
    assert grad == pytest.approx([-2.64 / N] * 3 + [0.8 / N] * 2 + [0.0])
    logps, old, behav = batch()
    logps = (old + 0.5).requires_grad_()  # a later pass: u = e^0.5 = 1.65, far past 1 + eps_high, not clipped
    loss, stats = async_grpo.async_loss(logps, old, behav, None, A2, MASK, loss_args(correction="vcpo"), 2, MASK.sum())
    (g,) = torch.autograd.grad(loss, logps)
    assert g[0, 0].item() == pytest.approx(-2.64 * math.exp(0.5) / N) and stats["clip_high"].item() == 0


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_vcpo_baseline_weights_are_the_squared_norms_of_the_models_own_score_gradients(tiny_model, tokenizer, loss_agg):
    """b_g = sum W^2 |h|^2 R / sum W^2 |h|^2, h = grad log pi(y|x) as the loss applies it (/|y| under seq-mean-token-mean),
    the norms recomputed here through the model's own forward, row by row; A = (R - b_g) / (std_g + 1e-4); the lr factor
    sqrt(ESS / B); a group whose rewards are all equal keeps A = 0 exactly."""
    from common.rollout import rollout

    prompts = ["123>", "123>", "45>", "45>", "67>", "67>"]
    out = rollout(tiny_model, tokenizer, prompts, [(0, i) for i in range(6)], 5, 1.0, [tokenizer.eos_token_id], "cpu")
    out.logprobs = out.logprobs - torch.tensor([[0.3], [-0.2], [0.0], [0.5], [0.1], [0.2]]) * out.completion_mask  # stale mu
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 0.7])
    args = async_grpo.Args(num_generations=2, max_new_tokens=5, loss_agg=loss_agg)
    advantages, stats = async_grpo.vcpo_advantages(tiny_model.train(), out, rewards, True, args)
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    norms, log_W = [], []
    for i in range(6):
        x = out.prompt_ids[i][out.prompt_mask[i].bool()]
        y = out.completion_ids[i][out.completion_mask[i].bool()]
        logits = tiny_model(input_ids=torch.cat([x, y])[None]).logits[0, len(x) - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, y[:, None])[:, 0]
        score = logps.mean() if loss_agg == "seq-mean-token-mean" else logps.sum()
        norms.append(sum(g.pow(2).sum() for g in torch.autograd.grad(score, params, allow_unused=True) if g is not None))
        log_W.append((logps.detach() - out.logprobs[i][out.completion_mask[i].bool()]).sum())
    capped = torch.stack(log_W).clamp(max=math.log(8.0))  # row 3's W = e^2.5 = 12 > 8: the weight the loss applies
    assert torch.stack(log_W).max() > math.log(8.0)
    weight = torch.exp(2 * capped) * torch.stack(norms)
    for g in (0, 1):
        rows = slice(2 * g, 2 * g + 2)
        b = (weight[rows] * rewards[rows]).sum() / weight[rows].sum()
        expected = (rewards[rows] - b) / (rewards[rows].std() + 1e-4)
        assert advantages[rows].tolist() == pytest.approx(expected.tolist(), rel=1e-3, abs=1e-5)
    assert advantages[4:].tolist() == [0.0, 0.0]  # 0.7 and 0.7: no signal, whatever the weights' rounding
    W_ = torch.exp(torch.stack(log_W))
    assert stats["offpolicy/vcpo_lr_scale"] == pytest.approx(math.sqrt(W_.sum() ** 2 / (6 * (W_**2).sum())), rel=1e-4)


def test_vcpo_scales_the_steps_learning_rate_and_restores_it(tmp_path, monkeypatch):
    """The optimiser steps at lr * sqrt(ESS / B) and its param groups read --lr again afterwards."""
    seen = []
    real = async_grpo.optimizer_step
    monkeypatch.setattr(async_grpo, "optimizer_step",
                        lambda optimizer, *a: seen.append(optimizer.param_groups[0]["lr"]) or real(optimizer, *a))
    async_grpo.main(small_args(async_grpo, tmp_path, steps=3, mode="emulated", max_staleness=2, correction="vcpo",
                               eval_every=0, prompts_per_step=4))
    rows = read_metrics(tmp_path / "run")[1:]
    assert seen == pytest.approx([5e-4 * r["offpolicy/vcpo_lr_scale"] for r in rows])
    assert rows[0]["offpolicy/vcpo_lr_scale"] == 1.0 and rows[-1]["offpolicy/vcpo_lr_scale"] < 1.0  # step 1: on-policy


@pytest.mark.parametrize("correction", ["seq-tis", "seq-mis", "vcpo"])
def test_sequence_corrections_take_the_one_batch_step_in_micro_batches(tmp_path, correction):
    one = micro_batches_take_the_one_batch_step(async_grpo, tmp_path, ("loss", "policy/grad_norm", "offpolicy/mask_frac",
                                                                        "offpolicy/cap_frac"),
                                                steps=3, mode="emulated", max_staleness=2, correction=correction,
                                                eval_every=0, seq_cap=1.05, prompts_per_step=4)
    if correction != "vcpo":
        assert any(r["offpolicy/mask_frac"] + r["offpolicy/cap_frac"] > 0 for r in one[1:])  # the correction acted


@pytest.mark.parametrize("overrides, message", [(dict(seq_cap=0.0), r"--seq-cap must be > 0 \(got 0.0\)"),
                                                (dict(vcpo_cap=-1.0), r"--vcpo-cap must be > 0 \(got -1.0\)")])
def test_async_grpo_refuses_a_cap_out_of_range(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(async_grpo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=message):
        async_grpo.main(small_args(async_grpo, tmp_path, **overrides))


# ---------------------------------------------------------------- VC-PPO: decoupled GAE, value warm-up
def test_decoupled_gae_gives_the_critic_monte_carlo_returns_and_the_actor_its_own_lambda():
    """rewards 0, 0, 1 on three tokens, V = 0.2, 0.3, 0.4, gamma 1: at --critic-lam 1 every return is 1 (the final
    reward, undecayed); the advantages (before whitening) are GAE's at --lam 0.95 either way."""
    rewards, values, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.3, 0.4]]), torch.ones(1, 3)
    args = ppo.Args(lam=0.95, critic_lam=1.0, no_eos_penalty=None)
    adv_095, ret_095 = ppo.gae(rewards, values, mask, 1.0, 0.95)
    _, decoupled = ppo.advantages_and_returns(torch.tensor([1.0]), torch.tensor([True]), torch.zeros(1, 3), None, values,
                                              mask, 0.0, args)
    assert decoupled.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert ret_095[0, 0].item() == pytest.approx(0.2 + adv_095[0, 0].item()) and ret_095[0, 0].item() < 1.0
    whitened, coupled = ppo.advantages_and_returns(torch.tensor([1.0]), torch.tensor([True]), torch.zeros(1, 3), None,
                                                   values, mask, 0.0, ppo.Args(lam=0.95, no_eos_penalty=None))
    assert coupled.flatten().tolist() == pytest.approx(ret_095.flatten().tolist())


def test_the_value_warm_up_trains_the_critic_alone(tiny_model, tokenizer):
    """A step of ppo.optimise within --value-warmup-steps moves the value head and leaves every policy weight as it was
    (the value loss's gradient through the shared body is dropped); the step after it moves the policy."""
    from accelerate import Accelerator

    from common.rollout import rollout

    batch = rollout(tiny_model, tokenizer, ["12>", "345>"] * 4, [(0, i) for i in range(8)], 6, 1.0,
                    [tokenizer.eos_token_id], "cpu")
    model = ppo.ActorCritic(tiny_model.train())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = ppo.Args(value_warmup_steps=1, minibatches=2, ppo_epochs=2, max_new_tokens=6)
    mask = batch.completion_mask.float()
    with torch.no_grad():
        logits, old_values = model(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        old_logps = torch.log_softmax(logits.float(), -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    advantages, returns = torch.randn_like(mask) * mask, torch.ones_like(mask) * mask
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = ppo.optimise(model, optimizer, Accelerator(cpu=True), batch, old_logps, old_values * mask, advantages,
                           returns, args, step=1)
    after = model.state_dict()
    assert metrics["value/warmup"] == 1.0 and metrics["policy/ratio_max"] == pytest.approx(1.0)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("policy."))
    assert not torch.equal(before["value_head.weight"], after["value_head.weight"])
    ppo.optimise(model, optimizer, Accelerator(cpu=True), batch, old_logps, old_values * mask, advantages, returns, args,
                 step=2)
    assert not all(torch.equal(before[k], model.state_dict()[k]) for k in before if k.startswith("policy."))


def test_the_critic_learns_at_its_own_rate_and_the_warm_up_runs_in_two_processes(tmp_path):
    """--vf-lr: the critic's parameter group (value head) steps at it, the policy's at --lr; --value-warmup-steps with
    two processes (DDP reduces every gradient: the policy's terms stay in the warm-up's graph at weight 0)."""
    from conftest import launch_two_processes

    ppo.main(small_args(ppo, tmp_path, steps=1, prompts_per_step=16, num_generations=1, minibatches=2, eval_every=0,
                        vf_lr=1e-2))
    state = torch.load(next((tmp_path / "run" / "checkpoints").glob("step_*")) / "state.pt", weights_only=False)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [1e-4, 1e-2]
    out = launch_two_processes("ppo.py", "--steps", "2", "--prompts-per-step", "16", "--num-generations", "1",
                               "--minibatches", "1", "--ppo-epochs", "2", "--value-warmup-steps", "1", "--eval-every", "0",
                               "--eval-prompts", "8", "--device", "cpu", "--output-dir", str(tmp_path), "--run-name", "ddp")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["value/warmup"] for r in read_metrics(tmp_path / "ddp")[1:]] == [1.0, 0.0]


@pytest.mark.parametrize("overrides, message", [
    (dict(critic_lam=1.5), "--critic-lam must be in \\[0, 1\\]"),
    (dict(value_warmup_steps=5, steps=5), "--value-warmup-steps must be in \\[0, --steps\\)"),
])
def test_ppo_refuses_vc_ppo_values_out_of_range(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(ppo, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=message):
        ppo.main(small_args(ppo, tmp_path, **{"prompts_per_step": 16, "num_generations": 1, **overrides}))
