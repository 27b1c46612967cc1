"""docs/troubleshooting.md, with real worker processes: a Python exception inside a rollout worker surfaces on
the trainer with the worker's traceback (not retried), and a rollout batch that never arrives ends in a clear
``TimeoutError`` after ``rollout_timeout_s`` instead of a hang."""

import re
import threading
import time

import pytest
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer
from trl_async.rollout.pool import RolloutLaneError

from ..conftest import COMMON, async_args, letter_reward, no_rollout_children, text_dataset

# transformers accepts `stop_strings` in a GenerationConfig but rejects it inside `generate` when no tokenizer is
# passed; neither GRPOTrainer's `generate` call nor the worker's passes one. So this setting makes the worker's own
# `model.generate` raise, for real, on its first generate call.
STOP_STRINGS = {"stop_strings": ["\n"]}
NO_TOKENIZER = "we could not locate a tokenizer"


def test_an_exception_in_a_worker_is_raised_on_the_trainer_with_its_traceback_and_not_retried(
    tmp_path, tiny_model_dir
):
    # the same setting fails GRPOTrainer itself at its first generation: the input is invalid, not our pipeline
    sync = GRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, train_dataset=text_dataset(),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), generation_kwargs=STOP_STRINGS,
                                       **{**COMMON, "max_steps": 1}))  # fmt: skip
    with pytest.raises(ValueError, match=NO_TOKENIZER):
        sync.train()

    args = async_args(
        tmp_path / "async", generation_kwargs=STOP_STRINGS, rollout_timeout_s=120, rollout_max_restarts=3
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    start = time.monotonic()
    with pytest.raises(RolloutLaneError) as raised:
        trainer.train()
    elapsed = time.monotonic() - start

    message = str(raised.value)
    assert re.search(r"rollout worker 0 \(pid \d+\) failed", message)
    # the worker's traceback: the original exception type and message, and frames from the worker's own code
    assert "Traceback (most recent call last)" in message
    assert "ValueError: There are one or more stop strings" in message and NO_TOKENIZER in message
    assert (
        "trl_async/engines/transformers/worker.py" in message
        and "in generate_groups" in message
        and "in worker_main" in message
    )
    # reported as soon as it happens, not found by the rollout timeout
    assert elapsed < 60
    pool = trainer.last_rollout_pool
    # not retried: no restart (a restarted worker would fail again, and after rollout_max_restarts the error would
    # name an exit code instead of the traceback), and the worker is not counted as lost
    assert pool.lane_restarts == 0 and pool.lost_lanes == []
    assert trainer.state.global_step == 0
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes)) and no_rollout_children()


def test_a_rollout_batch_that_never_arrives_raises_timeout_error_after_rollout_timeout_s(tmp_path, tiny_model_dir):
    """The workers are healthy and generate, but scoring (the collector thread) is stuck in a reward function, so no
    scored group ever reaches the queue. ``take`` must give up after ``rollout_timeout_s`` with an error that says
    so, and ``train`` must release the workers."""
    entered, release = threading.Event(), threading.Event()

    def stuck_reward(prompts, completions, **kwargs):
        entered.set()
        release.wait(120)  # bounded: never outlives the test session by much, even if release were never set
        return [0.0] * len(completions)

    class ClockedTrainer(AsyncGRPOTrainer):
        closing_at = None

        def close_rollouts(self):  # train()'s finally: runs right after the error is raised
            self.closing_at = self.closing_at or time.monotonic()
            super().close_rollouts()

    timeout_s = (
        10  # the first batch's wait includes the workers' start-up (~2.5 s here; margin for a loaded CI machine)
    )
    args = async_args(tmp_path, rollout_timeout_s=timeout_s, max_staleness=0)  # heartbeat timeout: default 10 s
    trainer = ClockedTrainer(model=tiny_model_dir, reward_funcs=stuck_reward, args=args, train_dataset=text_dataset())
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as raised:
            trainer.train()
        returned = time.monotonic()
        pool = trainer.last_rollout_pool
        # the groups did arrive and reached the reward function, which never returned
        assert entered.is_set()
        assert no_rollout_children() and not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes))
    finally:
        release.set()

    message = str(raised.value)
    assert f"waited {timeout_s}s (rollout_timeout_s)" in message
    assert "for 2 more rollout groups at trainer version 0" in message  # the whole first batch (2 groups) missing
    assert "alive [True]" in message  # a healthy worker: the wait, not the worker, is what failed
    # it gave up after rollout_timeout_s, not sooner (the wait began after `start`) and not much later
    assert timeout_s <= trainer.closing_at - start < timeout_s + 10
    # and train() released the workers in bounded time (the close waits at most 5 s for the stuck scoring thread)
    assert returned - trainer.closing_at < 10
    assert trainer.state.global_step == 0
    assert pool.lane_restarts == 0 and pool.lost_lanes == []


def test_an_iterable_dataset_whose_stream_stalls_times_out_rather_than_hanging_the_pool(tmp_path, tiny_model_dir):
    """The stream gives one generation batch to the rollout side, then its next read never returns (a network read
    that hangs, say). The read is on the stream's own thread, never under the pool's lock: the first step trains,
    the next batch's wait gives up after ``rollout_timeout_s``, and ``train`` returns and releases the workers."""
    from datasets import IterableDataset

    stalled = threading.Event()

    def rows():
        for i in range(12):
            if i == 2 and threading.current_thread().name == "trl_async-stream":
                stalled.set()
                threading.Event().wait(60)  # bounded: never outlives the test session by much
            yield {"prompt": f"q{i}:", "letter": "abcdefghijkl"[i]}

    timeout_s = 10  # margin for the workers' start-up on a loaded machine
    args = async_args(tmp_path, rollout_timeout_s=timeout_s, max_staleness=0, max_steps=3, shuffle_dataset=False)
    stream = IterableDataset.from_generator(rows)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=stream)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rollout_timeout_s"):
        trainer.train()
    assert stalled.is_set() and trainer.state.global_step == 1  # the first batch trained; the second never came
    assert time.monotonic() - start < 2 * timeout_s + 20  # not the stalled read's 60 s
    assert no_rollout_children()
