"""Which ready group the trainer takes next (rollout/consumption.py): orders worked out by hand, then a real run."""

import json

import pytest

from tests.conftest import async_args, letter_reward, text_dataset
from trl_async import AsyncGRPOTrainer
from trl_async.rollout.consumption import next_ready


@pytest.mark.unit
def test_arrival_order_takes_whatever_finished_first():
    assert next_ready([7, 3, 5], pending_ids={3, 4, 5, 7}, window=None) == 0
    assert next_ready([], pending_ids={3}, window=None) is None


@pytest.mark.unit
def test_strict_admission_order_waits_for_the_oldest_pending_group():
    # groups 3..7 pending; 7 and 5 are ready, 3 (the oldest) is still generating: wait
    assert next_ready([7, 5], pending_ids={3, 4, 5, 6, 7}, window=1) is None
    # 3 arrives last of the three: it is taken first
    assert next_ready([7, 5, 3], pending_ids={3, 4, 5, 6, 7}, window=1) == 2
    # after 3 is taken, 4 is the oldest pending and not ready: wait again, though 5 is
    assert next_ready([7, 5], pending_ids={4, 5, 6, 7}, window=1) is None


@pytest.mark.unit
def test_a_window_lets_groups_overtake_the_oldest_by_at_most_window_minus_one():
    # oldest pending 3, window 3: ids 3, 4, 5 may be taken; 7 may not. Of 7 and 5, 5 (index 1)
    assert next_ready([7, 5], pending_ids={3, 4, 5, 6, 7}, window=3) == 1
    # once 5 is taken, 4 could still go, then nothing past 5 until 3 is in: 7 never overtakes 3
    assert next_ready([7], pending_ids={3, 4, 6, 7}, window=3) is None
    # the oldest of the allowed ready ones first, whatever arrived first
    assert next_ready([5, 4], pending_ids={3, 4, 5}, window=3) == 1
    # gaps (dropped or filtered groups left the pending set) do not widen the window: 3 + 3 is still the limit
    assert next_ready([6, 9], pending_ids={3, 6, 9}, window=3) is None


def test_with_window_one_batches_train_in_admission_order_and_none_is_dropped(tmp_path, tiny_model_dir):
    """Two workers, one group per generate call: groups finish out of order, yet every step trains the oldest
    groups (each step's ids all below the next step's), and admission control's promise holds: nothing too stale."""
    args = async_args(tmp_path, max_steps=6, max_staleness=2, num_rollout_workers=2, rollout_batch_groups=1,
                      rollout_consumption_window=1, rollout_trajectory_file="traj.jsonl")  # fmt: skip
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args,
                               train_dataset=text_dataset())  # fmt: skip
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    by_step: dict[int, set[int]] = {}
    for r in rows:
        by_step.setdefault(r["step"], set()).add(r["group_id"])
    assert sorted(by_step) == list(range(6)) and all(len(ids) == 2 for ids in by_step.values())
    order = [sorted(by_step[s]) for s in range(6)]
    assert [i for ids in order for i in ids] == list(range(12)), order  # admission order, no gaps: nothing dropped
    assert trainer.last_rollout_pool.dropped_groups == 0
