"""The arithmetic of the benchmarks against values worked out by hand: the dedicated-device bound from the synchronous
schedule's phases, when a curve reaches its target and the share of groups dynamic sampling dropped
(time_to_accuracy.py), the dedicated-core prediction (predict_dedicated.py), and the workers' busy share
(throughput.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from time_to_accuracy import filtered_share, phase_bound, time_to  # noqa: E402


def test_the_bound_comes_from_the_synchronous_schedules_phases_without_the_first_step():
    # first steps (start-up) are 99 s and left out; then waits 10, 12, 10, 8 (G = 10) in steps of 50, 50, 52, 48
    # (mean 50, so T = 40): overlap gains at most (10 + 40) / 40 = 1.25
    runs = [
        {"step_s": [99.0, 50.0, 50.0], "trainer_wait_s": [99.0, 10.0, 12.0]},
        {"step_s": [99.0, 52.0, 48.0], "trainer_wait_s": [99.0, 10.0, 8.0]},
    ]
    phases = phase_bound(runs)
    assert phases["G_s"] == pytest.approx(10.0)
    assert phases["T_s"] == pytest.approx(40.0)
    assert phases["bound"] == pytest.approx(1.25)
    # generation-dominated: G = 30 of a 40 s step, T = 10: (30 + 10) / 30
    generation_bound = phase_bound([{"step_s": [1.0, 40.0], "trainer_wait_s": [1.0, 30.0]}])
    assert generation_bound["bound"] == pytest.approx(4 / 3)
    assert phase_bound([{"step_s": [1.0], "trainer_wait_s": [1.0]}]) is None  # nothing after the first step


def test_time_to_a_target_interpolates_between_evaluations_and_not_from_step_zero():
    curve = [(0, 0.0, 0.2), (4, 100.0, 0.3), (8, 200.0, 0.5)]
    assert time_to(curve, 0.4) == pytest.approx(150.0)  # halfway from 0.3 to 0.5
    assert time_to(curve, 0.25) == pytest.approx(100.0)  # first reached by training at step 4, not before it
    assert time_to(curve, 0.5) == pytest.approx(200.0)
    assert time_to(curve, 0.6) is None


def test_the_filtered_share_counts_every_trained_group_against_the_dropped_ones():
    # 12 steps of 2 prompts trained 24 groups; 8 more were dropped: 8 of 32 scored
    assert filtered_share({"filtered_groups": 8, "step_s": [1.0] * 12}, prompts_per_step=2) == 0.25
    assert filtered_share({"filtered_groups": 0, "step_s": [1.0] * 12}, prompts_per_step=2) == 0.0
    assert filtered_share({"filtered_groups": None, "step_s": [1.0] * 12}, prompts_per_step=2) is None  # option off


@pytest.mark.unit
def test_the_dedicated_prediction_takes_one_core_rates_from_shared_core_runs_only():
    from predict_dedicated import predict, shared_core_rates, steady_s_per_step

    # GRPOTrainer on one thread: step 1 (start-up) left out; G = mean(4, 6) = 5, T = mean(20-4, 24-6) = 17
    one_thread = [{"generate_s": [9.0, 4.0, 6.0], "step_s": [40.0, 20.0, 24.0]}]
    rates = shared_core_rates(one_thread, [{"weight_sync_s_mean": 0.5}, {"weight_sync_s_mean": 1.5}])
    assert rates == {"G_s": 5.0, "T_s": 17.0, "S_s": 1.0}
    assert steady_s_per_step([{"step_s": [99.0, 10.0, 12.0]}, {"step_s": [99.0, 14.0]}]) == 12.0
    # one worker on its own core: in lock-step a step is G + T + S = 23 s; one step of staleness hides generation
    # behind training, so the trainer alone sets the pace, T + S = 18 s
    assert predict(rates, 0) == pytest.approx(23.0)
    assert predict(rates, 1) == pytest.approx(18.0)


@pytest.mark.unit
def test_the_worker_engine_rates_are_its_generate_calls_and_the_trainer_step_less_its_wait():
    from predict_dedicated import compare, worker_engine_rates

    # first call and first step left out: G = mean(3, 5, 4) = 4; T = mean(20-2, 22-6, 17-0) = 17; S = mean(0.2, 0.4)
    runs = [{"config": "async_1+1", "worker_generate_s": [30.0, 3.0, 5.0], "step_s": [50.0, 20.0, 22.0],
             "trainer_wait_s": [40.0, 2.0, 6.0], "weight_sync_s_mean": 0.2},
            {"config": "async_1+1", "worker_generate_s": [20.0, 4.0], "step_s": [60.0, 17.0],
             "trainer_wait_s": [50.0, 0.0], "weight_sync_s_mean": 0.4}]  # fmt: skip
    assert worker_engine_rates(runs) == pytest.approx({"G_s": 4.0, "T_s": 17.0, "S_s": 0.3})
    # the dedicated runs are predicted from those rates only: lock-step G + T + S = 21.3 s (measured 25: -14.8%)
    rates, rows = compare(runs + [{"config": "ded_sync", "step_s": [99.0, 25.0, 25.0]}])
    assert list(rates) == ["async_1+1"] and rows[0]["config"] == "ded_sync"
    assert rows[0]["predicted_s_per_step[async_1+1]"] == pytest.approx(21.3)
    assert rows[0]["error[async_1+1]"] == pytest.approx(21.3 / 25 - 1)
    # a run with evaluations (its workers stopped mid-call) is no rate source, nor is a set of runs without one
    with pytest.raises(ValueError, match="--eval_every 0"):
        worker_engine_rates([{**runs[0], "eval_s": 12.0}])
    with pytest.raises(ValueError, match="no rate source"):
        compare([{"config": "ded_sync", "step_s": [99.0, 25.0]}])


@pytest.mark.unit
def test_a_workers_busy_share_counts_its_overlapping_group_spans_once():
    from throughput import busy_share

    # a continuously batching worker's spans nest and overlap (its submits share its slots).
    # lane 1: (0, 4) and (2, 6) are busy from 0 to 6, 4 s of the window (1, 5); lane 2: (1, 3), 2 s of it.
    # Two workers over a 4 s window: (4 + 2) / (4 * 2) = 0.75 (summing the spans would give 8 / 8 = 1.0)
    calls = [(1, 0.0, 4.0), (1, 2.0, 6.0), (2, 1.0, 3.0)]
    assert busy_share(calls, 1.0, 5.0, workers=2) == pytest.approx(0.75)
    # spans that only touch, or lie apart, are counted as they are
    assert busy_share([(0, 0.0, 1.0), (0, 1.0, 2.0), (0, 3.0, 4.0)], 0.0, 4.0, workers=1) == pytest.approx(0.75)
    assert busy_share([], 0.0, 4.0, workers=1) == 0.0
