"""Importance weighting recovers the on-policy policy gradient from stale samples (a categorical "1-token LM").

Policy pi = softmax(theta) over K actions, reward r. Exact on-policy gradient of J = sum_a pi_a r_a:
    g = pi * (r - <pi, r>)          (d/dtheta of sum_a pi_a r_a)
From n samples a_i ~ mu (a stale policy), the per-sample estimate is h_i = w_i * r_{a_i} * (e_{a_i} - pi), where
e_{a_i} - pi = d log pi(a_i) / d theta. With w = pi/mu (no truncation) E[h] = g exactly; with w = 1 ("none") E[h] is
the gradient weighted by mu instead of pi, i.e. biased. The tolerance is 5 standard errors of the sample mean.
"""

import torch

from trl_async.correction.importance import off_policy_correction

K, N = 6, 200_000


def setup():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(K, generator=gen, dtype=torch.float64)
    stale = theta + 1.0 * torch.randn(K, generator=gen, dtype=torch.float64)  # mu: the policy some versions ago
    pi, mu = torch.softmax(theta, 0), torch.softmax(stale, 0)
    r = torch.arange(K, dtype=torch.float64) / K  # reward per action
    actions = torch.multinomial(mu, N, replacement=True, generator=gen)
    return pi, mu, r, actions


def per_sample_terms(pi, mu, r, actions, mode, cap):
    prox_logps, behaviour_logps = torch.log(pi[actions])[:, None], torch.log(mu[actions])[:, None]  # (N, 1 token)
    w = off_policy_correction(prox_logps, behaviour_logps, torch.ones(N, 1), mode=mode, cap=cap).weights_BT[:, 0]
    score = torch.nn.functional.one_hot(actions, K).double() - pi  # d log pi(a) / d theta
    return (w * r[actions])[:, None] * score  # (N, K)


def estimate(terms):
    return terms.mean(0), terms.std(0) / N**0.5


def test_untruncated_importance_weights_are_unbiased_and_none_is_biased():
    pi, mu, r, actions = setup()
    exact = pi * (r - (pi * r).sum())
    for mode in ("tis", "decoupled", "seq_tis"):  # with an infinite cap each is plain IS: w = pi/mu
        mean, se = estimate(per_sample_terms(pi, mu, r, actions, mode, cap=float("inf")))
        assert ((mean - exact).abs() <= 5 * se).all(), (mode, mean, exact, se)
    mean, se = estimate(per_sample_terms(pi, mu, r, actions, "none", cap=2.0))
    bias = (mean - exact).abs()
    assert (bias > 10 * se).any(), (bias, se)  # measurably biased on the same draws
    assert bias.norm() > 0.1 * exact.norm()


def test_truncation_reduces_variance_at_a_bounded_bias():
    pi, mu, r, actions = setup()
    exact = pi * (r - (pi * r).sum())
    full = per_sample_terms(pi, mu, r, actions, "tis", cap=float("inf"))
    capped = per_sample_terms(pi, mu, r, actions, "tis", cap=1.5)
    assert (pi / mu).max() > 1.5  # the cap binds for some actions, so the comparison means something
    var_full, var_capped = full.var(0).sum(), capped.var(0).sum()
    assert var_capped < 0.9 * var_full, (var_capped, var_full)
    # still much closer to the on-policy gradient than ignoring staleness
    none_bias = (per_sample_terms(pi, mu, r, actions, "none", cap=2.0).mean(0) - exact).norm()
    assert (capped.mean(0) - exact).norm() < none_bias


if __name__ == "__main__":  # python tests/integration/test_unbiasedness.py: the numbers quoted in the issue notes
    pi, mu, r, actions = setup()
    exact = pi * (r - (pi * r).sum())
    for mode, cap in (("tis", float("inf")), ("none", 2.0), ("tis", 1.5)):
        terms = per_sample_terms(pi, mu, r, actions, mode, cap)
        mean, se = estimate(terms)
        z = ((mean - exact).abs() / se).max().item()
        print(f"{mode:>4} cap {cap}: bias norm {(mean - exact).norm():.4f}, max |z| {z:.1f}, "
              f"summed variance {terms.var(0).sum():.3f}")  # fmt: skip
