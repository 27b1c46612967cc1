"""Off-policy correction: importance weights for stale samples, as pure tensor functions (no trainer state).

Notation: mu = behaviour policy (the distribution the rollout engine sampled each token from, logged per token);
pi_prox = the trainer's policy when the batch is consumed, processed the way the engine processes its logits (the
repetition penalty, temperature, top-k/top-p/min-p; ``sampling.py``), or mu itself in bypass mode; rho = pi_prox/mu.
So at staleness 0 rho is 1 whatever the sampler, and a token the proximal policy's own truncation would not sample
gets rho = 0.
Every mode uses the *decoupled* structure of AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System for Language Reasoning", eq. 5): GRPOTrainer's clipped ratio is taken against pi_prox
(``old_per_token_logps``), so its trust region is about the update, and a staleness weight w = f(rho) multiplies the
per-token loss (``importance_sampling_ratio``). The modes differ only in f:

  none       w = 1                                    stale samples treated as on-policy (ablation only)
  tis        w = min(rho_t, C)                        truncated IS (IMPALA's rho-bar, Espeholt et al. 2018; "TIS",
                                                      Yao et al. 2025)
  mask       w = rho_t * 1[C_min <= rho_t <= C_max]   masked IS (TRL's token_mask, IcePop-style band)
  seq_tis    w = min(rho_seq, C)                      sequence level, rho_seq = exp(mean_t log rho_t), the geometric
  seq_mask   w = rho_seq * 1[C_min <= rho_seq <= C_max]  mean, so length does not explode the weight (cf. TRL #5814)
  decoupled  w = rho_t * 1[rho_t <= C]                AReaL's decoupled PPO with ``behav_imp_weight_cap``: tokens
                                                      whose weight exceeds the cap are filtered out, others keep rho

Shapes: ``_BT`` = (batch, completion tokens); ``mask_BT`` marks real completion tokens. Padding gets weight 1 (the loss
masks it anyway), all-masked rows get a sequence ratio of 1, and no function returns NaN for an empty mask. A token
whose mu is NaN (a backend returned no log-prob) gets rho = 1, as GRPOTrainer does, and is counted (``behaviour_nan``);
it is left out of a sequence's geometric mean and of ``kl_behaviour``.

Two things these weights are not:
- The sequence modes' geometric mean is a length-normalised heuristic, not an unbiased IS weight: E_mu[rho_seq] is
  not 1 in general (for a fixed length T > 1 it is at most 1, by Jensen's inequality; where the length depends on
  the tokens, as at an EOS, it can be either side of 1). It keeps long sequences' weights from exploding (the product
  of T ratios does); with the default band it seldom binds.
- The KL penalty (``beta`` > 0) is not reweighted: it is computed on the stale samples as if on-policy, as
  GRPOTrainer computes it on vLLM's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_MODES = ("tis", "mask", "decoupled")
SEQUENCE_MODES = ("seq_tis", "seq_mask")
MODES = ("none", *TOKEN_MODES, *SEQUENCE_MODES)
LOG_RATIO_CLAMP = 20.0  # |log rho| beyond this is numerically meaningless; keeps exp() finite


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over the masked entries; 0 (not NaN) when the mask is empty."""
    mask = mask_BT.to(x_BT.dtype)
    return (x_BT * mask).sum() / mask.sum().clamp(min=1.0)


def log_ratio(prox_logps_BT: torch.Tensor, behaviour_logps_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log rho_t = log pi_prox - log mu, clamped to +-20, 0 on padding (whatever junk padding holds) and where mu is
    missing (NaN: a backend that could not give it), as GRPOTrainer treats a missing vLLM log-prob: no correction."""
    lr = (prox_logps_BT - behaviour_logps_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask_BT.bool() & ~torch.isnan(lr), lr, torch.zeros_like(lr))


def sequence_log_ratio(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log rho_seq = mean over a sequence's tokens of log rho_t (geometric mean of ratios), shape (B, 1); 0 for a row
    with no tokens."""
    mask = mask_BT.to(log_ratio_BT.dtype)
    return ((log_ratio_BT * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def truncate(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """min(rho, C)."""
    return ratio.clamp(max=cap)


def band_mask(ratio: torch.Tensor, floor: float, cap: float) -> torch.Tensor:
    """rho where C_min <= rho <= C_max, else 0."""
    return torch.where((ratio >= floor) & (ratio <= cap), ratio, torch.zeros_like(ratio))


def cap_filter(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """rho where rho <= C, else 0 (AReaL's behaviour-weight filter)."""
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


@dataclass(frozen=True)
class Correction:
    """The weights to hand to GRPOTrainer's loss, and the statistics practitioners read."""

    weights_BT: torch.Tensor
    stats: dict[str, float]
    units: int = 0  # the tokens (or sequences) the statistics are over; 0: they are the empty-batch defaults


def effective_sample_size(weights: torch.Tensor) -> float:
    """ESS fraction (sum w)^2 / (n sum w^2) in [0, 1]: 1 = all weights equal; 0 when every weight is 0; 1 for n = 0."""
    n = weights.numel()
    if n == 0:
        return 1.0
    w = weights.double()
    denom = n * (w**2).sum()
    return min(1.0, float(w.sum() ** 2 / denom)) if denom > 0 else 0.0  # <= 1 by Cauchy-Schwarz; clamp rounding


def off_policy_correction(
    prox_logps_BT: torch.Tensor,
    behaviour_logps_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    cap: float,
    floor: float = 0.0,
) -> Correction:
    """Weights w = f(pi_prox / mu) for ``mode`` (see the module docstring) and their statistics.

    Statistics are over the units the mode weighs (tokens, or sequences for ``seq_*``): ``ratio_mean/min/max`` of the
    raw rho, ``ess`` of the final weights, ``truncated_frac`` (rho > C in truncating modes), ``masked_frac`` (weights
    set to 0), ``behaviour_nan`` (tokens without a behaviour log-prob, given rho = 1), and ``kl_behaviour``, the k3
    estimate of KL(mu || pi_prox) = E_mu[rho - 1 - log rho] over tokens (Schulman 2020, "Approximating KL divergence").
    """
    if mode not in MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; expected one of {MODES}")
    mask = mask_BT.bool()
    lr_BT = log_ratio(prox_logps_BT, behaviour_logps_BT, mask_BT)
    rho_BT = torch.exp(lr_BT)
    # tokens with a behaviour log-prob: the means below leave the others out (their rho = 1 would pull a geometric
    # mean towards 1, where GRPOTrainer's sequence product is unchanged by a factor 1)
    known_BT = mask & ~torch.isnan(behaviour_logps_BT)
    kl = masked_mean(rho_BT - 1 - lr_BT, known_BT).item()

    if mode in SEQUENCE_MODES:
        rho_units = torch.exp(sequence_log_ratio(lr_BT, known_BT))  # (B, 1)
        valid_units = mask.any(-1, keepdim=True)
    else:
        rho_units, valid_units = rho_BT, mask

    if mode == "none":
        w_units = torch.ones_like(rho_units)
    elif mode in ("tis", "seq_tis"):
        w_units = truncate(rho_units, cap)
    elif mode in ("mask", "seq_mask"):
        w_units = band_mask(rho_units, floor, cap)
    else:  # decoupled
        w_units = cap_filter(rho_units, cap)

    weights_BT = torch.where(mask, w_units.expand_as(rho_BT), torch.ones_like(rho_BT))
    valid_rho, valid_w = rho_units[valid_units], w_units[valid_units]
    n = max(valid_rho.numel(), 1)
    truncating = mode in ("tis", "seq_tis")
    stats = {
        "ratio_mean": valid_rho.mean().item() if valid_rho.numel() else 1.0,
        "ratio_min": valid_rho.min().item() if valid_rho.numel() else 1.0,
        "ratio_max": valid_rho.max().item() if valid_rho.numel() else 1.0,
        "ess": effective_sample_size(valid_w),
        "truncated_frac": (valid_rho > cap).sum().item() / n if truncating else 0.0,
        "masked_frac": (valid_w == 0).sum().item() / n,
        "kl_behaviour": kl,
        "behaviour_nan": int((torch.isnan(behaviour_logps_BT) & mask).sum()),  # tokens given ratio 1 for want of mu
    }
    return Correction(weights_BT=weights_BT, stats=stats, units=valid_rho.numel())


# how each statistic combines across ranks: the mean of the ranks' values (as GRPOTrainer gathers its per-rank
# metrics), the extremes of ratio_min/max, the total of behaviour_nan
_ACROSS_RANKS = {"ratio_min": min, "ratio_max": max, "behaviour_nan": sum}


def stats_across_ranks(per_rank: list[dict[str, float]], units: list[int]) -> dict[str, float]:
    """One rank's view of a step's statistics made global: every rank logs the same values. A rank with no units
    (``units[r] == 0``: every row masked, e.g. all truncated) holds only the empty-batch defaults and is left out,
    unless every rank is empty."""
    kept = [stats for stats, n in zip(per_rank, units, strict=True) if n > 0] or per_rank
    return {
        name: _ACROSS_RANKS.get(name, lambda v: sum(v) / len(v))([stats[name] for stats in kept]) for name in kept[0]
    }
