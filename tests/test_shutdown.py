"""Closing the episode and rollout_func runners is deterministic: their threads are joined first, then what they hold
is released, by the thread that owns it; a reset or rollout still running at close releases its environments when it
returns and starts nothing new."""

import threading
import time

import pytest

from trl_async.records import RolloutTask
from trl_async.rollout.custom_rollouts import RolloutFuncRunner
from trl_async.rollout.episodes import EnvironmentPool, EpisodeRunner
from trl_async.rollout.tool_calls import ToolRunner
from trl_async.tiny import build_char_tokenizer

pytestmark = pytest.mark.unit  # threads only, no processes


def _episode_runner(environments, submitted, failed):
    return EpisodeRunner(
        tokenizer=build_char_tokenizer(), chat_template=None, chat_template_kwargs={}, tools=[], max_rounds=1,
        max_completion_length=4, max_model_len=None, tool_runner=ToolRunner(1, 5.0, None), tool_dicts=({}, {}),
        submit_turn=submitted.append, finished=lambda group: None, fail=failed.append, environments=environments,
        row=lambda group_id: {"prompt": [{"role": "user", "content": "hi"}]}, num_generations=2,
        abandon=lambda task, why: None,
    )  # fmt: skip


def test_a_reset_still_running_at_close_releases_its_environment_and_no_reset_starts_after():
    made, resetting = [], threading.Event()

    class SlowEnvironment:
        def __init__(self):
            made.append(self)

        def reset(self, **kwargs):
            resetting.set()
            time.sleep(1.0)
            return "ok"

    environments = EnvironmentPool({None: SlowEnvironment})
    submitted, failed = [], []
    runner = _episode_runner(environments, submitted, failed)
    runner.start(RolloutTask(0, 0, (), 0))
    runner.start(RolloutTask(1, 1, (), 0))
    assert resetting.wait(5)
    started = time.monotonic()
    runner.close(timeout_s=0.1)
    assert time.monotonic() - started < 0.9  # close does not wait out a slow reset
    runner._thread.join(5)
    runner.tool_runner.close()
    assert not runner._thread.is_alive()
    assert len(made) == 1  # the reset under way finished; none started after close
    assert environments._free[None] == made  # and its instance went back to the pool
    assert not submitted and not failed  # no turn of a closed runner's group was asked for


def test_closing_the_rollout_func_runner_waits_for_a_running_rollout():
    running, finished_rollouts, delivered, failed = threading.Event(), [], [], []

    def slow_rollout(prompts, trainer):
        running.set()
        time.sleep(1.0)
        finished_rollouts.append(len(prompts))
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2]] * len(prompts),
                "logprobs": [[-1.0]] * len(prompts), "policy_version": 0}  # fmt: skip

    trainer = type("Trainer", (), {"state": type("State", (), {"global_step": 0})()})()
    runner = RolloutFuncRunner(rollout_func=slow_rollout, trainer=trainer, tokenizer=object(), num_generations=2,
                               timeout_s=30, max_model_len=None, max_new_tokens=4, submit_turn=lambda task: None,
                               finished=delivered.append, fail=failed.append, row=lambda group_id: {"prompt": "a"})  # fmt: skip
    runner.start(RolloutTask(0, 0, (), 0))
    assert running.wait(5)
    runner.close(timeout_s=5)
    assert finished_rollouts == [2]  # joined: the rollout had returned when close did
    assert not delivered and not failed  # its group was not handed to the closed pool, and nothing failed


def _never_reads(seconds):
    time.sleep(seconds)


@pytest.mark.integration
def test_stopping_a_worker_whose_task_pipe_is_full_kills_it_instead_of_blocking_on_the_pipe():
    """The dispatcher registers a chunk, then pipes it; a chunk larger than the pipe's buffer blocks until the worker
    reads. A worker that never reads again (itself blocked sending a large result nobody drains) must still be
    stopped: stop() may not first pipe its own exit request, which would block behind the chunk forever."""
    import multiprocessing

    from trl_async.engines.transformers.worker_process import WorkerProcess

    ctx = multiprocessing.get_context("fork")
    task_recv, task_send = ctx.Pipe(duplex=False)
    result_recv, result_send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_never_reads, args=(60,), daemon=True)
    process.start()
    task_recv.close()
    result_send.close()
    task = RolloutTask(group_id=0, prompt_index=0, prompt_ids=(1,) * 300_000, admitted_at_version=0)
    worker = WorkerProcess(None, process, task_send, result_recv, ctx.Value("d", time.time()))
    worker.outstanding[(0, 0)] = task

    def transmit():
        try:
            worker.transmit([task])
        except OSError:  # the worker was killed mid-send
            pass

    dispatcher = threading.Thread(target=transmit, daemon=True)
    dispatcher.start()
    dispatcher.join(1.0)
    assert dispatcher.is_alive(), "the chunk fitted in the pipe: the test needs one that blocks"
    stopping = threading.Thread(target=worker.stop, args=(0.0,), daemon=True)
    stopping.start()
    stopping.join(5.0)
    alive = stopping.is_alive()
    if alive:  # free the blocked threads before failing
        process.kill()
    assert not alive, "stop() blocked on the full task pipe"
    assert not process.is_alive()
    dispatcher.join(5.0)
    assert not dispatcher.is_alive(), "the blocked transmit did not end when the worker was killed"
