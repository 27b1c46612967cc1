"""The generate spans a pool records per lane (``RolloutPool.activity``), which benchmarks read as worker busy time."""

import threading
from collections import deque
from types import SimpleNamespace

import pytest

from trl_async.records import RolloutGroup
from trl_async.rollout.lanes import Lanes


def _group(key: int, started: float, seconds: float) -> RolloutGroup:
    return RolloutGroup(group_id=key, prompt_index=0, prompt_ids=(1,), completion_ids=((2,),), logprobs=((0.0,),),
                        versions=((0,),), lane_id=0, generate_s=seconds, generate_started_at=started)  # fmt: skip


@pytest.mark.unit
def test_a_static_call_is_one_span_and_a_continuous_submit_spans_until_its_last_group_finishes():
    activity: deque = deque()
    delivered = []
    lanes = Lanes(SimpleNamespace(specs=[]), None, threading.Condition(), activity,
                  lambda group, task: delivered.append(group.group_id), None, None)  # fmt: skip
    lane = SimpleNamespace(outstanding={(k, ()): f"task {k}" for k in range(6)})
    # a static generate call of 3 groups: one start, one duration, one span (10, 12)
    for key in range(3):
        lanes._handle(lane, _group(key, 10.0, 2.0))
    # a continuous worker's submit of 3 groups at 20: they finish at 21, 23 and 23; the worker was busy until 23
    lanes._handle(lane, _group(3, 20.0, 1.0))
    lanes._handle(lane, _group(4, 20.0, 3.0))
    lanes._handle(lane, _group(5, 20.0, 3.0))
    assert delivered == [0, 1, 2, 3, 4, 5]
    assert list(activity) == [("generate", 0, 10.0, 12.0), ("generate", 0, 20.0, 21.0), ("generate", 0, 20.0, 23.0)]
