import math

import pytest
import torch

from trl_async.correction.importance import (
    effective_sample_size,
    masked_mean,
    off_policy_correction,
    sequence_log_ratio,
)

LOG = math.log


def case(ratios, mask):
    """behaviour log-probs 0 and prox log-probs log(ratio): rho equals ``ratios`` exactly."""
    prox = torch.log(torch.tensor(ratios, dtype=torch.float64))
    return prox, torch.zeros_like(prox), torch.tensor(mask)


# rho per token: row 0 = [2, 0.5, 1, (pad)], row 1 = [4, 0.25, (pad), (pad)]
RHO = [[2.0, 0.5, 1.0, 9.0], [4.0, 0.25, 7.0, 7.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize(
    "mode,cap,floor,expected",
    [
        # tis: min(rho, 1.5); padding -> 1
        ("tis", 1.5, 0.0, [[1.5, 0.5, 1.0, 1.0], [1.5, 0.25, 1.0, 1.0]]),
        # mask: rho inside [0.4, 3], else 0: 4 and 0.25 are outside
        ("mask", 3.0, 0.4, [[2.0, 0.5, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]),
        # decoupled (AReaL): rho if rho <= 3 else 0; no floor
        ("decoupled", 3.0, 0.0, [[2.0, 0.5, 1.0, 1.0], [0.0, 0.25, 1.0, 1.0]]),
        # seq_tis: geometric means: row 0 (2*0.5*1)^(1/3) = 1; row 1 (4*0.25)^(1/2) = 1 -> both 1 (< cap)
        ("seq_tis", 1.5, 0.0, [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]),
        ("none", 1.5, 0.0, [[1.0] * 4, [1.0] * 4]),
    ],
)
def test_weights_by_hand(mode, cap, floor, expected):
    out = off_policy_correction(*case(RHO, MASK), mode=mode, cap=cap, floor=floor)
    torch.testing.assert_close(out.weights_BT, torch.tensor(expected, dtype=torch.float64))


def test_sequence_modes_use_the_geometric_mean():
    # row 0: tokens [4, 4] -> geometric mean 4 -> seq_tis caps at 2, seq_mask (band [0.5, 3]) drops the row;
    # row 1: tokens [2, 0.5, 0.5] -> (0.5)^(1/3) = 0.7937 -> kept by both
    ratios, mask = [[4.0, 4.0, 1.0], [2.0, 0.5, 0.5]], [[1, 1, 0], [1, 1, 1]]
    g = 0.5 ** (1 / 3)
    tis = off_policy_correction(*case(ratios, mask), mode="seq_tis", cap=2.0)
    torch.testing.assert_close(tis.weights_BT, torch.tensor([[2.0, 2.0, 1.0], [g, g, g]], dtype=torch.float64))
    masked = off_policy_correction(*case(ratios, mask), mode="seq_mask", cap=3.0, floor=0.5)
    torch.testing.assert_close(masked.weights_BT, torch.tensor([[0.0, 0.0, 1.0], [g, g, g]], dtype=torch.float64))
    assert masked.stats["masked_frac"] == 0.5 and tis.stats["truncated_frac"] == 0.5
    assert masked.stats["ratio_max"] == pytest.approx(4.0) and masked.stats["ratio_min"] == pytest.approx(g)


def test_statistics_by_hand():
    out = off_policy_correction(*case(RHO, MASK), mode="tis", cap=1.5)
    valid = [2.0, 0.5, 1.0, 4.0, 0.25]
    assert out.stats["ratio_mean"] == pytest.approx(sum(valid) / 5)
    assert out.stats["ratio_min"] == 0.25 and out.stats["ratio_max"] == 4.0
    assert out.stats["truncated_frac"] == pytest.approx(2 / 5)  # 2 and 4 exceed 1.5
    w = [1.5, 0.5, 1.0, 1.5, 0.25]
    assert out.stats["ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    # k3 = mean(rho - 1 - log rho)
    assert out.stats["kl_behaviour"] == pytest.approx(sum(r - 1 - LOG(r) for r in valid) / 5)


def test_on_policy_gives_unit_weights_and_full_ess():
    logps = torch.log(torch.rand(3, 5))
    for mode in ("tis", "mask", "decoupled", "seq_tis", "seq_mask"):
        out = off_policy_correction(logps, logps.clone(), torch.ones(3, 5), mode=mode, cap=2.0, floor=0.5)
        assert torch.equal(out.weights_BT, torch.ones(3, 5))
        assert out.stats["ess"] == 1.0 and out.stats["ratio_min"] == out.stats["ratio_max"] == 1.0
        assert out.stats["kl_behaviour"] == 0.0


@pytest.mark.parametrize("mode", ["none", "tis", "mask", "decoupled", "seq_tis", "seq_mask"])
def test_all_masked_rows_and_empty_masks_give_no_nan(mode):
    prox, behaviour = torch.tensor([[0.0, -50.0]]), torch.tensor([[-50.0, float("-inf")]])
    for mask in ([[0, 0]], [[1, 0]]):
        out = off_policy_correction(prox, behaviour, torch.tensor(mask), mode=mode, cap=2.0, floor=0.5)
        assert torch.isfinite(out.weights_BT).all()
        assert all(math.isfinite(v) for v in out.stats.values()), out.stats


def test_every_weight_masked_has_zero_ess():
    out = off_policy_correction(*case([[10.0, 20.0]], [[1, 1]]), mode="decoupled", cap=5.0)
    assert out.stats["ess"] == 0.0 and out.stats["masked_frac"] == 1.0


def test_helpers_are_empty_safe():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1, 1, 0]])).item() == 2.0
    assert masked_mean(x, torch.zeros(1, 3)).item() == 0.0
    assert sequence_log_ratio(x, torch.zeros(1, 3)).item() == 0.0
    assert effective_sample_size(torch.tensor([])) == 1.0


@pytest.mark.parametrize("mode", ["tis", "mask", "decoupled", "none"])
def test_a_missing_behaviour_logprob_gets_ratio_one_and_is_counted(mode):
    """A NaN mu (a null log-prob from a vLLM server) cannot be corrected: like GRPOTrainer, its ratio is 1 and the
    other tokens keep theirs; the count is reported."""
    prox, behaviour, mask = case(RHO, MASK)
    behaviour[0, 1] = float("nan")  # rho would have been 0.5
    behaviour[1, 3] = float("nan")  # padding: not counted
    out = off_policy_correction(prox, behaviour, mask, mode=mode, cap=3.0, floor=0.4)
    reference = off_policy_correction(*case([[2.0, 1.0, 1.0, 9.0], RHO[1]], MASK), mode=mode, cap=3.0, floor=0.4)
    torch.testing.assert_close(out.weights_BT, reference.weights_BT)
    assert out.stats["behaviour_nan"] == 1 and reference.stats["behaviour_nan"] == 0
    assert all(math.isfinite(v) for v in out.stats.values())


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mask"])
def test_a_missing_behaviour_logprob_leaves_the_sequence_ratio_to_the_other_tokens(mode):
    """The neutral treatment of an uncorrectable token: GRPOTrainer's sequence ratio is a product, where its factor 1
    changes nothing; in our geometric mean it must leave the count too, or it pulls the sequence's ratio towards 1.
    Row 0 = [2, (no mu), 1]: sqrt(2 * 1), not (2 * 1 * 1)^(1/3); row 1 = [4, 0.25]: 1. The k3 KL estimate is likewise
    a mean over the tokens that have a mu: (2 - 1 - ln 2 + 0 + (4 - 1 - ln 4) + (0.25 - 1 - ln 0.25)) / 4."""
    prox, behaviour, mask = case(RHO, MASK)
    behaviour[0, 1] = float("nan")
    out = off_policy_correction(prox, behaviour, mask, mode=mode, cap=3.0, floor=0.4)
    r = math.sqrt(2.0)
    expected = torch.tensor([[r, r, r, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.weights_BT, expected)
    assert out.stats["ratio_max"] == pytest.approx(r)
    k3 = sum(x - 1 - math.log(x) for x in (2.0, 1.0, 4.0, 0.25)) / 4
    assert out.stats["kl_behaviour"] == pytest.approx(k3)


def test_statistics_across_ranks_by_hand():
    """Means of the ranks' values (GRPOTrainer gathers its metrics so), the extremes of the extremes, the total of
    the count."""
    from trl_async.correction.importance import stats_across_ranks

    rank0 = {"ratio_mean": 1.0, "ratio_min": 0.5, "ratio_max": 2.0, "ess": 0.9, "behaviour_nan": 1, "masked_frac": 0.0}
    rank1 = {
        "ratio_mean": 2.0,
        "ratio_min": 0.25,
        "ratio_max": 1.5,
        "ess": 0.7,
        "behaviour_nan": 2,
        "masked_frac": 0.5,
    }
    expected = {"ratio_mean": 1.5, "ratio_min": 0.25, "ratio_max": 2.0, "ess": 0.8, "behaviour_nan": 3,
                "masked_frac": 0.25}  # fmt: skip
    assert stats_across_ranks([rank0, rank1], [3, 5]) == pytest.approx(expected)
    assert stats_across_ranks([rank0], [3]) == rank0
    # a rank with nothing to weigh holds only the defaults (ratios 1, ess 1): left out, unless all ranks are empty
    empty = {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "ess": 1.0, "behaviour_nan": 0, "masked_frac": 0.0}
    assert stats_across_ranks([rank1, empty], [5, 0]) == pytest.approx(rank1)
    assert stats_across_ranks([empty, empty], [0, 0]) == empty
    assert off_policy_correction(*case(RHO, MASK), mode="tis", cap=2.0).units == 5
    assert off_policy_correction(*case(RHO, [[0] * 4, [0] * 4]), mode="seq_tis", cap=2.0).units == 0
