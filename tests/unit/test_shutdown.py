"""Closing the episode and rollout_func runners is deterministic: their threads are joined first, then what they hold
is released, by the thread that owns it; a reset or rollout still running at close releases its environments when it
returns and starts nothing new."""

import threading
import time

from trl_async.demo.tiny import build_char_tokenizer
from trl_async.records import RolloutTask
from trl_async.rollout.environments import EnvironmentPool
from trl_async.rollout.episodes import EpisodeRunner
from trl_async.rollout.rollout_func import RolloutFuncRunner
from trl_async.rollout.tool_calls import ToolRunner


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
    runner.open()
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

    view = lambda generate, tokenizer: None  # noqa: E731 - the rollout above uses none of it
    runner = RolloutFuncRunner(rollout_func=slow_rollout, trainer_view=view, version=lambda: 0, tokenizer=object(),
                               num_generations=2,
                               timeout_s=30, max_model_len=None, max_new_tokens=4, submit_turn=lambda task: None,
                               finished=delivered.append, fail=failed.append, row=lambda group_id: {"prompt": "a"})  # fmt: skip
    runner.start(RolloutTask(0, 0, (), 0))
    assert running.wait(5)
    runner.close(timeout_s=5)
    assert finished_rollouts == [2]  # joined: the rollout had returned when close did
    assert not delivered and not failed  # its group was not handed to the closed pool, and nothing failed
