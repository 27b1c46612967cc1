import pytest

from trl_async.rollout.admission import AdmissionLedger


def test_nothing_is_admitted_before_the_first_publish():
    ledger = AdmissionLedger(groups_per_batch=4, steps_per_batch=1, max_staleness=1, queue_size=100)
    assert ledger.limit() == 0 and ledger.room() == 0
    with pytest.raises(ValueError, match="room for 0"):
        ledger.admit(1)


def test_staleness_bounds_admission_then_memory_does():
    # B=4, one step per batch, max_staleness=1: with version 0 published, batches consumed at versions 0 and 1 are
    # fresh for a group generated now: 8 groups. A queue of 6 binds first.
    ledger = AdmissionLedger(groups_per_batch=4, steps_per_batch=1, max_staleness=1, queue_size=6, published=0)
    assert ledger.limit() == 6 and ledger.room() == 6
    ledger.admit(6)
    assert ledger.room() == 0 and ledger.in_flight == 6
    ledger.consume(4)  # batch 0 trained: the queue frees 4 slots, but staleness allows only 8 - 6 = 2 more
    assert ledger.limit() == 8 and ledger.room() == 2 and ledger.in_flight == 2
    ledger.published = 1  # version 1 published: batches 0..2 are fresh, 12 groups; the queue allows 4 + 6 = 10
    assert ledger.limit() == 10 and ledger.room() == 4


def test_a_group_that_leaves_untrained_returns_its_slot():
    ledger = AdmissionLedger(groups_per_batch=2, steps_per_batch=1, max_staleness=0, queue_size=10, published=0)
    ledger.admit(2)
    assert ledger.room() == 0
    ledger.give_back()  # dropped as stale, filtered, abandoned or handed back by a lost lane
    assert ledger.room() == 1 and ledger.admitted == 1 and ledger.in_flight == 1
    with pytest.raises(ValueError, match="giving back 2 groups with 1 in flight"):
        ledger.give_back(2)
    with pytest.raises(ValueError, match="consuming 2 groups with 1 in flight"):
        ledger.consume(2)


def test_resumed_run_counts_batches_from_its_start_version():
    # resumed at step 3, 2 steps per batch: batches are consumed at versions 3, 5, ... With version 4 published and
    # max_staleness=0, the batch consumed at 5 would be 1 stale: (4 + 0 - 3) // 2 = 0, batch 0's 2 groups in total
    ledger = AdmissionLedger(groups_per_batch=2, steps_per_batch=2, max_staleness=0, queue_size=10, start_version=3,
                             published=4)  # fmt: skip
    assert ledger.limit() == 2


def test_a_group_already_too_stale_is_known_before_scoring():
    ledger = AdmissionLedger(groups_per_batch=2, steps_per_batch=1, max_staleness=1, queue_size=10)
    assert not ledger.too_stale_already([0])  # nothing published yet
    ledger.published = 3
    assert not ledger.too_stale_already([2, 3])  # oldest token 2: 3 - 2 = 1 <= 1
    assert ledger.too_stale_already([1, 3])  # oldest token 1: 3 - 1 = 2 > 1
    assert not ledger.too_stale_already([4])  # sampled a moment before publish() recorded 4: not stale
