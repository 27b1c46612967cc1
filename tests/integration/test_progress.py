from trl_async.reporting.progress import run_summary


def test_run_summary_from_log_history():
    history = [
        {"step": 1, "reward": 0.25, "async/staleness_mean": 0.0, "async/staleness_max": 0, "async/dropped_stale": 0,
         "async/trainer_wait_s": 0.5},
        {"step": 2, "reward": 0.75, "async/staleness_mean": 1.0, "async/staleness_max": 1, "async/dropped_stale": 8,
         "async/trainer_wait_s": 0.1},
        {"step": 2, "train_runtime": 4.0},
    ]  # fmt: skip
    summary = run_summary(history, train_seconds=4.0, samples_per_step=16)
    assert summary == {
        "steps": 2,
        "train_seconds": 4.0,
        "samples_per_s": 8.0,  # 2 steps x 16 samples / 4 s
        "reward_first": 0.25,
        "reward_last": 0.75,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "dropped_stale_samples": 8,
        "trainer_wait_s_per_step": 0.3,
    }


def test_run_summary_of_a_synchronous_run_has_no_async_fields():
    summary = run_summary([{"step": 3, "reward": 0.5}], train_seconds=3.0, samples_per_step=4)
    assert summary == {"steps": 3, "train_seconds": 3.0, "samples_per_s": 4.0, "reward_first": 0.5, "reward_last": 0.5}
