"""rollout_cpu_affinity: which cores the rollout workers run on, and the trainer keeping the rest."""

import os
import threading

import pytest
import torch
from transformers import TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.hardware.cores import parse_cpu_list, split_cores

from ..conftest import COMMON, async_args, letter_reward, text_dataset

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.unit
def test_cpu_lists_parse_as_taskset_writes_them():
    assert parse_cpu_list("1") == (1,)
    assert parse_cpu_list("0-3") == (0, 1, 2, 3)
    assert parse_cpu_list("4-6, 12,5") == (4, 5, 6, 12)
    assert parse_cpu_list([3, 1, 3]) == (1, 3) and parse_cpu_list(2) == (2,)
    for bad in ("", "a", "3-1", "1-", "-1", "1,,2", [-1], [1.5], True, []):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


@pytest.mark.unit
def test_workers_get_contiguous_shares_and_the_trainer_the_rest():
    split = split_cores([4, 5, 6, 7, 8], allowed=range(16), num_workers=2)
    assert split.workers == ((4, 5, 6), (7, 8))
    assert split.trainer == (0, 1, 2, 3, 9, 10, 11, 12, 13, 14, 15)
    assert split_cores([1], allowed=[0, 1], num_workers=1).workers == ((1,),)
    assert split_cores([2, 3], allowed=range(4), num_workers=3).workers == ((2,), (3,), (2,))  # fewer cores: shared
    with pytest.raises(ValueError, match=r"cores \[7\] are not among"):
        split_cores([1, 7], allowed=[0, 1, 2], num_workers=1)
    with pytest.raises(ValueError, match="leaves the trainer none"):
        split_cores([0, 1], allowed=[0, 1], num_workers=1)


@pytest.mark.unit
def test_a_bad_affinity_is_refused_at_construction_naming_the_field(tmp_path):
    def config(cores):
        return AsyncGRPOConfig(output_dir=str(tmp_path), **{**COMMON, "rollout_cpu_affinity": cores})

    with pytest.raises(ValueError, match=r"rollout_cpu_affinity='0-x' is invalid: not a CPU list"):
        config("0-x")
    with pytest.raises(ValueError, match=r"rollout_cpu_affinity=.* is invalid: .*leaves the trainer none"):
        config(",".join(map(str, ALLOWED)))
    outside = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"is invalid: cores \[{outside}\] are not among the cores"):
        config(str(outside))


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to give one to the workers")
def test_workers_run_on_the_cores_given_and_the_trainer_on_the_rest_with_threads_to_match(tmp_path, tiny_model_dir):
    rollout, trainer_cores = ALLOWED[-1:], ALLOWED[:-1]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(len(ALLOWED))  # so that the trainer's share (fewer threads) is a visible change
    seen = {}

    def thread_cores(pid):
        return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}

    class Inspect(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            (process,) = [lane.process for lane in trainer.rollout_pool.current_lanes]
            seen["worker"] = thread_cores(process.pid)  # every worker thread (its heartbeat thread too)
            seen["trainer"] = thread_cores(os.getpid())  # every trainer thread, also those started before training
            seen["trainer_threads"] = torch.get_num_threads()
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, process.pid) - os.getpriority(os.PRIO_PROCESS, 0)

    stop = threading.Event()
    earlier = threading.Thread(target=stop.wait, daemon=True)  # a thread of the user's, started before train()
    earlier.start()
    args = async_args(tmp_path, max_steps=2, rollout_cpu_affinity=",".join(map(str, rollout)))
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=text_dataset(),
        callbacks=[Inspect()],
    )
    try:
        trainer.train()
        assert seen["worker"] == {rollout} and seen["trainer"] == {trainer_cores}
        assert seen["trainer_threads"] == len(trainer_cores) and seen["nice"] == 0  # its own cores: no need to yield
        assert trainer.last_rollout_pool.placement == {0: (rollout, len(rollout))}  # as the worker reported it
        assert thread_cores(os.getpid()) == {ALLOWED} and torch.get_num_threads() == len(ALLOWED)  # restored
    finally:
        stop.set()
        torch.set_num_threads(threads_before)
