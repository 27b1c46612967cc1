"""Off-policy correction weights: pure tensor functions, no trainer state.

Notation (DESIGN.md): mu = behaviour policy (the rollout worker's sampling distribution, logged per token),
pi_prox = the trainer's policy when the batch is consumed (one extra forward pass). The weight enters GRPOTrainer's
own loss as ``importance_sampling_ratio`` (multiplied into the per-token loss), while GRPOTrainer's clipped ratio is
taken against ``old_per_token_logps = pi_prox``. Shapes: ``_BT`` = (batch, completion tokens).
"""

from __future__ import annotations

import torch


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over the masked entries; 0 (not NaN) when the mask is empty."""
    mask = mask_BT.to(x_BT.dtype)
    return (x_BT * mask).sum() / mask.sum().clamp(min=1.0)


def truncated_importance_weights(
    prox_logps_BT: torch.Tensor, behaviour_logps_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """Token-level truncated importance weight ``w = min(pi_prox / mu, cap)`` (TIS; Espeholt et al. 2018, IMPALA's
    rho-bar; Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL training").

    Padding positions (mask 0) get weight 1 (they are masked out of the loss anyway) so nothing downstream sees an
    inf/NaN from ``exp`` of a padded difference. The log-ratio is clamped at +-20 before ``exp`` for the same reason.
    """
    log_ratio = (prox_logps_BT - behaviour_logps_BT).clamp(-20.0, 20.0)
    weights = torch.exp(log_ratio).clamp(max=cap)
    return torch.where(mask_BT.bool(), weights, torch.ones_like(weights))
