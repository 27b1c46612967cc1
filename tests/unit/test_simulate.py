"""The pipeline simulator (benchmarks/simulate.py) against schedules worked out by hand."""

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from simulate import Pipeline, simulate  # noqa: E402

BASE = dict(workers=1, gen_call_s=2.0, groups_per_call=4, train_step_s=1.0, groups_per_step=4)


def test_zero_staleness_alternates_generation_and_training():
    # generate 2 s, train 1 s, strictly in turn: steps end at 3, 6, 9
    pred = simulate(Pipeline(max_staleness=0, **BASE), steps=3)
    assert pred.step_end_s == pytest.approx([3.0, 6.0, 9.0])
    assert pred.staleness == Counter({0: 12})
    assert pred.trainer_utilisation == pytest.approx(3 / 9)
    assert pred.worker_utilisation == pytest.approx(6 / 9)


def test_one_step_of_staleness_overlaps_and_becomes_generation_bound():
    # t=0-2 batch 0 (v0); admission allows batch 1 at once (v0, 2-4); the trainer trains batch 0 at 2-3 and publishes
    # v1; batch 2 starts at 4 with v1 (6), batch 3 at 6 with v2 (8). Steps end 3, 5, 7, 9: 2 s each, staleness 1.
    pred = simulate(Pipeline(max_staleness=1, **BASE), steps=4)
    assert pred.step_end_s == pytest.approx([3.0, 5.0, 7.0, 9.0])
    assert pred.staleness == Counter({0: 4, 1: 12})
    assert pred.seconds_per_step(warmup=1) == pytest.approx(2.0)


def test_trainer_bound_pipeline_runs_at_training_speed_with_sync_cost():
    # generate 1 s, train 2 s + 0.5 s sync: after the first batch the trainer never waits
    pred = simulate(Pipeline(max_staleness=2, **{**BASE, "gen_call_s": 1.0, "train_step_s": 2.0}, sync_s=0.5), 5)
    assert pred.step_end_s == pytest.approx([3.5, 6.0, 8.5, 11.0, 13.5])
    assert pred.trainer_utilisation == pytest.approx(12.5 / 13.5)


def test_two_workers_halve_a_generation_bound_step():
    two = {**BASE, "workers": 2, "groups_per_call": 2, "gen_call_s": 1.0}  # 2 groups per worker-second
    pred = simulate(Pipeline(max_staleness=1, **two), steps=20)
    assert pred.seconds_per_step(warmup=5) == pytest.approx(1.0)  # 4 groups per second, train 1 s
    assert max(pred.staleness) <= 1


def test_reward_latency_is_a_serial_stage_between_generation_and_training():
    # 4 groups x 0.25 s of scoring after each 2 s generate call. Sync: 2 + 1 + 1 = 4 s per step. With one step of
    # staleness scoring and training overlap the next call: t=0-2 gen b0, 2-3 score b0, 3-4 train; 2-4 gen b1,
    # 4-5 score b1, 5-6 train; 4-6 gen b2 (v1), 6-7 score, 7-8 train; 6-8 gen b3, 8-9 score, 9-10 train.
    sync = simulate(Pipeline(max_staleness=0, score_s=0.25, **BASE), steps=2)
    assert sync.step_end_s == pytest.approx([4.0, 8.0])
    overlapped = simulate(Pipeline(max_staleness=1, score_s=0.25, **BASE), steps=4)
    assert overlapped.step_end_s == pytest.approx([4.0, 6.0, 8.0, 10.0])


def test_concurrent_scorers_divide_the_reward_stage():
    # 4 groups x 1 s of scoring after each 2 s call, max_staleness 0 (phases in turn). One scorer: 2 + 4 + 1 = 7 s per
    # step; four scorers score the 4 groups at once: 2 + 1 + 1 = 4 s; two: 2 + 2 + 1 = 5 s.
    for scorers, per_step in ((1, 7.0), (2, 5.0), (4, 4.0)):
        pred = simulate(Pipeline(max_staleness=0, score_s=1.0, scorers=scorers, **BASE), steps=2)
        assert pred.step_end_s == pytest.approx([per_step, 2 * per_step]), scorers
