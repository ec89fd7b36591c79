"""Loss helpers shared by the algorithms: masked aggregation, KL estimators, group advantages.

The objectives themselves (clipped surrogates, value losses) are written out in each script.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPORTANCE_LEVELS = ("token", "sequence", "sequence-token")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_seqs: float | None = None,
              num_tokens: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar, counting only mask == 1 tokens.

      token-mean               sum_i sum_t l_it / N_tokens                      (DAPO; TRL's default)
      seq-mean-token-mean      sum_i (sum_t l_it / |y_i|) / N_seqs              (original GRPO)
      seq-mean-token-sum-norm  sum_i sum_t l_it / (N_seqs * max_len)            (Dr. GRPO)

    N_seqs and N_tokens default to this tensor's counts. When a batch is split into micro-batches
    (or across processes), pass the counts of the whole batch: the micro-batch losses then add up
    to the whole-batch loss, and so do their gradients. max_len is the completion budget
    (max_new_tokens), a constant, so Dr. GRPO's normaliser does not depend on the batch either.
    """
    mask = mask.to(per_token.dtype)
    num_seqs = per_token.shape[0] if num_seqs is None else num_seqs
    if mode == "token-mean":
        num_tokens = mask.sum() if num_tokens is None else num_tokens
        return (per_token * mask).sum() / num_tokens
    if mode == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        max_len = per_token.shape[1] if max_len is None else max_len
        return (per_token * mask).sum() / (num_seqs * max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose from {LOSS_AGG_MODES}")


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """The (B, T) importance ratio each token's clipped surrogate uses:

      token           r_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)                        (PPO, GRPO)
      sequence        s_i = exp(mean_t log r_it) = (pi_theta(y_i | x) / pi_old(y_i | x))^(1 / |y_i|)     (GSPO)
      sequence-token  s_it = sg(s_i) pi_theta(y_it | .) / sg(pi_theta(y_it | .)): the value of s_i, the gradient
                      s_i grad log pi_theta(y_it | .) of each token (GSPO-token; sg: stop-gradient)

    (GSPO: Zheng et al. 2025, arXiv:2507.18071; TRL's importance_sampling_level.) The mean runs over y_i's mask == 1
    tokens; a row with none gets s_i = 1."""
    log_ratio = logps - old_logps
    if level == "token":
        return torch.exp(log_ratio)
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance level {level!r}; choose from {IMPORTANCE_LEVELS}")
    mask = mask.to(log_ratio.dtype)
    log_s = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    if level == "sequence":
        return torch.exp(log_s).expand_as(logps)
    return torch.exp(log_s.detach() + logps - logps.detach())


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce=None) -> torch.Tensor:
    """(x - mean) / std over the mask == 1 entries (unbiased variance); masked entries are left as x. With reduce, a sum
    over processes (accelerator.reduce(t, "sum")), the mean and std are those of every process's entries: N processes
    whiten as one process does on the whole batch."""
    reduce = reduce or (lambda t: t)
    mask = mask.to(x.dtype)
    n = reduce(mask.sum())
    mean = reduce((x * mask).sum()) / n.clamp(min=1)
    var = reduce(((x - mean) ** 2 * mask).sum()) / (n.clamp(min=2) - 1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, x)


def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p, given log p and log q of each
    sampled token (Schulman's notes). With log_r = log q - log p, i.e. r = q / p:
      k1 = -log_r                   unbiased, high variance, can be negative
      k2 = log_r^2 / 2              biased, low variance
      k3 = (r - 1) - log_r          unbiased (E_p[r] = 1), low variance, always >= 0 (GRPO's choice)
    The first argument is the distribution the tokens came from. GRPO's penalty KL(pi_theta || pi_ref)
    is kl_estimate(logps, ref_logps); the logged policy/approx_kl, KL(pi_old || pi_theta) over tokens
    sampled from pi_old, is kl_estimate(old_logps, logps) (CleanRL's (r - 1) - log r with
    r = pi_theta / pi_old). Swapping the arguments does not estimate the reverse KL: E_p[1/r - 1 + log r]
    is chi^2(p || q) - KL(p || q).
    """
    log_r = logq - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r  # exp(log_r) - 1 - log_r, computed without cancellation
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {KL_ESTIMATORS}")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantage of each completion; rewards are laid out group by group (G consecutive rows).

      A_i = (R_i - mean_group(R)) / (std(R) + eps)
    with std the group's std (scale='group', DeepSeekMath), the whole batch's std (scale='batch'),
    or no division at all (scale='none', Dr. GRPO). std is the unbiased sample std, as in TRL.
    """
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = rewards.std()
    elif scale == "none":
        return centred
    else:
        raise ValueError(f"unknown reward scaling {scale!r}; choose from {SCALE_REWARDS}")
    return centred / (std + eps)


def frac_zero_std(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal: they carry no group-relative signal."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean().item()
