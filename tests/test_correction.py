import math

import torch

from trl_async.correction import masked_mean, truncated_importance_weights


def test_truncated_importance_weights_by_hand():
    # pi_prox / mu per token: 0.5/0.25 = 2 -> capped at 1.5; 0.25/0.5 = 0.5 kept; 0.3/0.3 = 1; padding -> 1
    prox = torch.log(torch.tensor([[0.5, 0.25, 0.3, 0.9]]))
    mu = torch.log(torch.tensor([[0.25, 0.5, 0.3, 0.1]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_importance_weights(prox, mu, mask, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0, 1.0]]))


def test_truncated_importance_weights_are_finite_for_extreme_and_padded_entries():
    prox = torch.tensor([[0.0, -1e4, 0.0]])
    mu = torch.tensor([[-1e4, 0.0, float("-inf")]])  # padded position may hold junk
    w = truncated_importance_weights(prox, mu, torch.tensor([[1, 1, 0]]), cap=2.0)
    assert torch.isfinite(w).all()
    assert w[0, 0] == 2.0 and w[0, 1] < 1e-8 and w[0, 2] == 1.0


def test_masked_mean_ignores_padding_and_is_zero_on_empty_mask():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1, 1, 0]])).item() == 2.0
    value = masked_mean(x, torch.zeros(1, 3)).item()
    assert value == 0.0 and not math.isnan(value)
