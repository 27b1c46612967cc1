from collections import deque
from types import SimpleNamespace

from trl_async.records import RolloutTask
from trl_async.rollout.dispatch import later_turn_chunk, load, pick_lane


def task(group_id, contexts=()):
    return RolloutTask(group_id, group_id, (1, 2), 0, contexts=contexts)


def lane(max_outstanding, *tasks):
    return SimpleNamespace(max_outstanding=max_outstanding, outstanding={t.key: t for t in tasks})


def test_a_later_turn_counts_as_its_share_of_a_group():
    # 4 rows per group: a first turn is 1 group; a later turn continuing 2 of a group's rows is half of one
    held = {t.key: t for t in (task(0), task(1, contexts=((5,), (6,))))}
    assert load(held, rows_per_group=4) == 1.5


def test_the_least_loaded_lane_with_room_takes_the_chunk_and_ties_go_to_the_longest_idle():
    busy, idle_a, idle_b = lane(4, task(0), task(1), task(2)), lane(4), lane(4)
    assert pick_lane([busy, idle_a, idle_b], per_call=2, rows_per_group=4, last_chunk={}) is idle_a
    # idle_a got chunk 7, idle_b chunk 3: idle_b has waited longer
    assert pick_lane([busy, idle_a, idle_b], 2, 4, {id(idle_a): 7, id(idle_b): 3}) is idle_b
    # 3 held + 2 more > 4: the busy lane has no room even alone
    assert pick_lane([busy], 2, 4, {}) is None
    assert pick_lane([busy], 1, 4, {}) is busy


def test_later_turns_fill_one_call_up_to_its_rows_and_always_take_one():
    turns = deque([task(0, contexts=((1,),) * 3), task(1, contexts=((1,),) * 2), task(2, contexts=((1,),) * 4)])
    assert [t.group_id for t in later_turn_chunk(turns, max_rows=5)] == [0, 1]  # 3 + 2 rows; + 4 would be 9
    assert [t.group_id for t in later_turn_chunk(turns, max_rows=2)] == [2]  # 4 rows > 2, but never an empty call
    assert not turns
