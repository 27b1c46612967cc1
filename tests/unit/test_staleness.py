import pytest

from trl_async.rollout.staleness import (
    default_queue_size,
    max_groups_admitted,
    staleness,
    too_stale_already,
    trainable,
)


def test_staleness_is_consumer_minus_oldest_token():
    assert staleness(5, [5, 5, 5]) == 0  # sampled with the weights the trainer holds now: on-policy
    assert staleness(5, [4, 5]) == 1  # one optimizer step between sampling and consumption
    assert staleness(7, [6, 3, 7]) == 4  # a sample is as stale as its oldest token (in-flight updates)


def test_staleness_rejects_future_versions_and_empty_samples():
    with pytest.raises(ValueError, match="newer"):
        staleness(3, [4])
    with pytest.raises(ValueError, match="at least one token"):
        staleness(3, [])


def test_admission_synchronous_alternates_generation_and_training():
    # max_staleness=0, 1 step per batch, 4 groups per batch: only batch 0 before the first publish, then one more
    # batch per published version.
    assert max_groups_admitted(0, 0, 4, 1) == 4
    assert max_groups_admitted(1, 0, 4, 1) == 8
    assert max_groups_admitted(5, 0, 4, 1) == 24


def test_admission_with_slack_and_multi_step_batches():
    # staleness 2: batches 0, 1, 2 may be generated with version 0 (consumed at versions 0, 1, 2).
    assert max_groups_admitted(0, 2, 4, 1) == 12
    # 2 optimizer steps per batch: batch j is consumed at version 2j. With version 0 and staleness 1: (0+1)//2 = 0,
    # so only batch 0; with version 1: (1+1)//2 = 1, batches 0 and 1.
    assert max_groups_admitted(0, 1, 4, 2) == 4
    assert max_groups_admitted(1, 1, 4, 2) == 8


def test_admission_counts_from_the_resumed_step():
    # resumed at version 10 (batch 10): version 10 published, staleness 0 -> just batch 10
    assert max_groups_admitted(10, 0, 3, 1, start_version=10) == 3
    assert max_groups_admitted(9, 0, 3, 1, start_version=10) == 0


def test_admission_after_a_resume_inside_a_generation_batch():
    # 2 optimizer steps per batch, resumed at step 3: GRPOTrainer generates at the resumed step, so batches are
    # consumed at versions 3, 5, 7. With max_staleness=0, version 4 must not admit the batch consumed at 5.
    assert max_groups_admitted(3, 0, 2, 2, start_version=3) == 2  # the batch consumed at 3
    assert max_groups_admitted(4, 0, 2, 2, start_version=3) == 2  # not yet the one consumed at 5
    assert max_groups_admitted(5, 0, 2, 2, start_version=3) == 4
    assert max_groups_admitted(4, 1, 2, 2, start_version=3) == 4  # staleness 1: 5 - 4 = 1 is fresh
    with pytest.raises(ValueError):
        max_groups_admitted(0, -1, 4, 1)


def test_the_guarantee_at_take():
    # consumed at version 5 with max_staleness 2: oldest token 3 trains (staleness 2), oldest 2 does not (3)
    assert trainable(5, [3, 4, 5], max_staleness=2)
    assert not trainable(5, [2, 5], max_staleness=2)
    assert trainable(0, [0], max_staleness=0)


def test_a_group_too_stale_for_any_future_step_is_known_before_scoring():
    # version 4 published: every later step consumes at >= 4, so tokens of version 1 are at least 3 stale
    assert too_stale_already(4, [1, 4], max_staleness=2)
    assert not too_stale_already(4, [2, 4], max_staleness=2)
    assert not too_stale_already(None, [0], max_staleness=0)  # nothing published yet
    # a lane may tag a token with a version a moment before the ledger records it published: not an error here
    assert not too_stale_already(3, [4], max_staleness=0)


def test_the_default_queue_holds_every_batch_the_bound_lets_run_ahead():
    # 4 groups per batch, 1 step per batch: max_staleness 0 -> this batch only; 2 -> this one and 2 more
    assert default_queue_size(0, 1, 4) == 4
    assert default_queue_size(2, 1, 4) == 12
    # 2 steps per batch: max_staleness 1 lets no later batch run ahead (1 // 2 = 0), 2 lets one
    assert default_queue_size(1, 2, 4) == 4
    assert default_queue_size(2, 2, 4) == 8
