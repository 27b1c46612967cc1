"""The rollout pool with real worker processes: admission control, backpressure, dropping stale groups, shutdown,
and lost workers (killed, stopped) restarted with their groups generated again."""

import logging
import os
import signal
import sys
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model
from trl_async.engines.transformers.worker import WorkerSpec
from trl_async.engines.transformers.worker_process import ProcessBackend
from trl_async.rollout.pool import PoolSettings, RolloutLaneError, RolloutPool
from trl_async.rollout.prompts import PromptStream
from trl_async.rollout.scored import ScoredGroup
from trl_async.weights.shared_memory import Digest

G = 2  # completions per group


def make_pool(
    max_staleness, groups_per_batch=2, queue_size=None, workers=1, score=None, rows=8, max_restarts=0, heartbeat_s=10.0,
    scoring_threads=1, max_new_tokens=3, publish_only=lambda name: True, timeout_s=60,
):  # fmt: skip
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, max_position_embeddings=max(256, max_new_tokens + 16))
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id, eos_token_id=[]
    )
    specs = [
        WorkerSpec(
            i,
            type(model),
            model.config,
            torch.float32,
            "cpu",
            gen,
            G,
            (tok.eos_token_id,),
            tok.pad_token_id,
            weight_update="batch",
            torch_threads=1,
            nice=0,
            seed=i,
            verify_weights=True,
        )
        for i in range(workers)
    ]
    settings = PoolSettings(
        groups_per_batch=groups_per_batch,
        steps_per_batch=1,
        max_staleness=max_staleness,
        queue_size=queue_size or (max_staleness + 1) * groups_per_batch,
        timeout_s=timeout_s,
        start_version=0,
        max_restarts=max_restarts,
        heartbeat_timeout_s=heartbeat_s,
        scoring_threads=scoring_threads,
    )
    prompts = PromptStream(rows, groups_per_batch, shuffle=False, seed=0)
    score = score or (lambda g, row, environments=None: ScoredGroup(g, rewards=torch.zeros(G, 1)))
    published = [(n, p) for n, p in model.named_parameters() if publish_only(n)]
    weight_specs = {n: (tuple(p.shape), p.dtype) for n, p in published}
    backend = ProcessBackend(specs, weight_specs, settings.groups_per_call)
    pool = RolloutPool(backend, settings, prompts, lambda i: {}, lambda i, row: ((5, 6, 7 + i), {}), score).start()
    pool.publish([published], 0, Digest())
    return pool, model


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_synchronous_admission_generates_exactly_one_batch_per_published_version():
    pool, model = make_pool(max_staleness=0)
    try:
        wait_until(lambda: pool.ready_count == 2)
        time.sleep(1.0)  # a worker that ignored admission would have produced more by now
        assert pool.admitted == 2 and pool.ready_count == 2
        groups, stats = pool.take(2, consumer_version=0)
        assert [g.group.prompt_index for g in groups] == [0, 1] and stats.staleness == [0] * 4
        time.sleep(1.0)  # consumed, but version 1 not published: the next batch may not start (it would be stale)
        assert pool.admitted == 2
        pool.publish([list(model.named_parameters())], 1, Digest())
        groups, stats = pool.take(2, consumer_version=1)
        assert [g.group.prompt_index for g in groups] == [2, 3]
        assert all(set(g.group.token_versions) == {1} for g in groups) and stats.staleness == [0] * 4
        assert pool.verified_adoptions >= 2  # the worker's weights hashed equal to what was published, twice
    finally:
        pool.close()
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes))


def test_queue_size_bounds_work_ahead_even_when_staleness_would_allow_more():
    pool, _ = make_pool(max_staleness=4, queue_size=3)  # admission would allow 5 batches = 10 groups
    try:
        wait_until(lambda: pool.ready_count == 3)
        time.sleep(1.0)
        assert pool.admitted == 3 and pool.ready_count == 3  # backpressure: nothing beyond the bound
        pool.take(2, consumer_version=0)
        wait_until(lambda: pool.admitted == 5)  # two slots freed -> two more admitted, and no more
        time.sleep(0.5)
        assert pool.admitted == 5
    finally:
        pool.close()


def test_stale_groups_are_dropped_counted_and_their_prompts_regenerated():
    pool, model = make_pool(max_staleness=0)
    try:
        wait_until(lambda: pool.ready_count == 2)  # prompts 0 and 1 generated with version 0
        pool.publish([list(model.named_parameters())], 1, Digest())
        groups, stats = pool.take(2, consumer_version=1)  # version-0 groups are 1 step stale: never trained on
        assert pool.dropped_groups == 2 and stats.dropped_samples_total == 2 * G
        assert sorted(g.group.prompt_index for g in groups) == [0, 1]  # same prompts, generated again
        assert all(set(g.group.token_versions) == {1} for g in groups)
    finally:
        pool.close()


def test_a_group_already_too_stale_when_it_arrives_is_dropped_without_scoring():
    """Reward calls can be expensive (a verifier, a judge): a group that no future batch could take is not scored."""
    release, scored_versions = threading.Event(), []

    def score(group, row, environments=None):
        scored_versions.append(min(group.token_versions))
        if len(scored_versions) == 1:
            release.wait(30)  # the second version-0 group arrives while version 1 is published
        return ScoredGroup(group, rewards=torch.zeros(G, 1))

    pool, model = make_pool(max_staleness=0, score=score)
    try:
        wait_until(lambda: len(scored_versions) == 1)
        pool.publish([list(model.named_parameters())], 1, Digest())
        release.set()
        groups, _ = pool.take(2, consumer_version=1)
        assert pool.dropped_groups == 2 and sorted(g.group.prompt_index for g in groups) == [0, 1]
        assert sorted(scored_versions) == [0, 1, 1]  # the second version-0 group was never scored
        assert pool.dropped_unscored == 1
    finally:
        pool.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_scoring_threads_score_groups_concurrently(threads):
    """A reward that waits (a verifier, a judge) overlaps with other groups' on several scoring threads: two groups
    meet at a barrier, which only concurrent scoring can pass; one thread scores one group at a time."""
    meet = threading.Barrier(2, timeout=5)

    def score(group, row, environments=None):
        meet.wait()
        return ScoredGroup(group, rewards=torch.zeros(G, 1))

    pool, _ = make_pool(max_staleness=0, score=score, scoring_threads=threads)
    try:
        if threads == 2:
            groups, _ = pool.take(2, consumer_version=0)
            assert len(groups) == 2
        else:
            with pytest.raises(threading.BrokenBarrierError):
                pool.take(2, consumer_version=0)
    finally:
        pool.close()


def hanging_score(release: threading.Event):
    """A reward function that hangs until ``release`` is set (at most 60 s)."""

    def score(group, row, environments=None):
        release.wait(60)
        return ScoredGroup(group, rewards=torch.zeros(G, 1))

    return score


def test_a_stuck_reward_does_not_stop_the_worker_health_checks():
    """Scoring runs off the collector thread: a worker killed while a reward function hangs is still noticed and
    restarted, not reported later as a rollout timeout."""
    release = threading.Event()

    score = hanging_score(release)

    pool, _ = make_pool(max_staleness=0, score=score, max_restarts=1)
    try:
        wait_until(lambda: pool.outstanding(0) == [] and pool.admitted == 2)  # both groups came back: scoring hangs
        os.kill(pool.current_lanes[0].process.pid, signal.SIGKILL)
        wait_until(lambda: pool.lane_restarts == 1, timeout=20)
    finally:
        release.set()
        pool.close()


def test_a_hung_reward_function_is_named_in_the_timeout_not_only_the_workers():
    """Both groups came back from the worker; one hangs in its reward function, the other waits behind it for the only
    scoring thread. The trainer's timeout must say so, not only list healthy workers."""
    release = threading.Event()

    score = hanging_score(release)

    pool, _ = make_pool(max_staleness=0, score=score, timeout_s=2)
    try:
        wait_until(lambda: pool.outstanding(0) == [] and pool.admitted == 2)
        time.sleep(0.5)  # the scoring thread has picked up the first group
        with pytest.raises(TimeoutError, match=r"1 group\(s\) inside reward functions, the longest for [0-9]+s; 1 "
                                               r"waiting to be scored"):  # fmt: skip
            pool.take(2, consumer_version=0)
    finally:
        release.set()
        pool.close()


def test_a_failure_after_the_last_batch_was_taken_is_reported_when_the_pool_closes(caplog):
    """Nothing takes from the pool after the last step, so an error raised then (here by the reward function, on the
    groups generated for a step that never comes) would otherwise vanish."""
    calls = []

    def score(group, row, environments=None):
        calls.append(group.group_id)
        if len(calls) > 2:
            raise ValueError("reward exploded after the last step")
        return ScoredGroup(group, rewards=torch.zeros(G, 1))

    pool, model = make_pool(max_staleness=0, score=score)
    try:
        pool.take(2, consumer_version=0)
        pool.publish([list(model.named_parameters())], 1, Digest())  # the next step's groups are generated and scored
        wait_until(lambda: pool._error is not None)
    finally:
        with caplog.at_level(logging.WARNING):
            pool.close()
    assert "reward exploded after the last step" in caplog.text


def test_a_failing_reward_function_surfaces_on_the_main_thread_not_as_a_hang():
    def score(group, row, environments=None):
        raise ValueError("reward exploded")

    pool, _ = make_pool(max_staleness=0, score=score)
    try:
        with pytest.raises(ValueError, match="reward exploded"):
            pool.take(2, consumer_version=0)
    finally:
        pool.close()


def test_a_killed_worker_is_reported_by_name():
    pool, _ = make_pool(max_staleness=0)
    try:
        wait_until(lambda: pool.ready_count == 2)
        pool.current_lanes[0].process.kill()
        pool.current_lanes[0].process.join(5)
        with pytest.raises(RolloutLaneError, match="rollout worker 0 .* exited with code"):
            pool.take(4, consumer_version=0)
    finally:
        pool.close()


def test_a_worker_killed_mid_generation_is_restarted_and_its_groups_generated_again():
    pool, model = make_pool(max_staleness=0, max_restarts=1)
    try:
        first, _ = pool.take(2, consumer_version=0)
        lost = pool.current_lanes[0].process
        os.kill(lost.pid, signal.SIGSTOP)  # hold it mid-task so it surely dies with groups in hand
        pool.publish([list(model.named_parameters())], 1, Digest())
        wait_until(lambda: len(pool.outstanding(0)) == 2)
        os.kill(lost.pid, signal.SIGKILL)
        groups, stats = pool.take(2, consumer_version=1)
        assert pool.lane_restarts == 1 and "exited with code -9" in pool.lost_lanes[0]
        assert pool.current_lanes[0].process.pid != lost.pid and not lost.is_alive()
        # the dead worker's two groups were generated again: same prompts, fresh version, none lost or doubled
        assert [g.group.prompt_index for g in first] == [0, 1]
        assert sorted(g.group.prompt_index for g in groups) == [2, 3]
        assert all(set(g.group.token_versions) == {1} for g in groups) and stats.staleness == [0] * 4
        time.sleep(1.0)
        assert pool.admitted == 4 and pool.ready_count == 0  # nothing generated twice
    finally:
        pool.close()
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes))


def test_closing_kills_a_worker_inside_a_generate_call_and_lets_an_idle_one_exit():
    """What a worker still generates when the pool closes is never used, so close does not wait for the call (2-3 s
    at the end of every train() on the real model); an idle worker exits by itself (exit code 0, not killed)."""
    busy, _ = make_pool(max_staleness=0, max_new_tokens=1500)  # one call of ~4 s here (no EOS: all 1500 tokens)
    try:
        wait_until(lambda: len(busy.outstanding(0)) == 2 and busy.lane_versions.get(0) == 0)
        time.sleep(0.5)  # inside its generate call
        assert busy.ready_count == 0
    finally:
        busy.close()
    assert busy.current_lanes[0].process.exitcode == -signal.SIGKILL
    idle, _ = make_pool(max_staleness=0)
    try:
        wait_until(lambda: idle.ready_count == 2)
        wait_until(lambda: not idle.outstanding(0))  # the batch is in: nothing more is admitted at version 0
    finally:
        idle.close(timeout_s=10)  # room to exit by itself on a loaded machine (a killed one would show -9)
    assert idle.current_lanes[0].process.exitcode == 0


def test_a_worker_whose_weights_miss_a_parameter_refuses_to_generate_and_names_it():
    """A worker's model is built without initialisation: a parameter the published weights do not cover would hold
    arbitrary memory, so the worker stops with its name instead of sampling from it."""
    pool, _ = make_pool(max_staleness=0, publish_only=lambda name: name != "model.norm.weight")
    try:
        with pytest.raises(RolloutLaneError, match=r"do not cover .*model\.norm\.weight"):
            pool.take(2, consumer_version=0)
    finally:
        pool.close()


def test_a_stopped_worker_misses_heartbeats_and_is_replaced():
    pool, model = make_pool(max_staleness=0, max_restarts=1, heartbeat_s=2.0)
    try:
        pool.take(2, consumer_version=0)
        stopped = pool.current_lanes[0].process
        os.kill(stopped.pid, signal.SIGSTOP)
        pool.publish([list(model.named_parameters())], 1, Digest())
        groups, _ = pool.take(2, consumer_version=1)  # served by the replacement
        assert sorted(g.group.prompt_index for g in groups) == [2, 3]
        assert "no heartbeat" in pool.lost_lanes[0] and not stopped.is_alive()
    finally:
        pool.close()


def test_a_stopped_worker_without_restarts_left_is_an_error_not_a_hang():
    pool, model = make_pool(max_staleness=0, max_restarts=0, heartbeat_s=2.0)
    try:
        pool.take(2, consumer_version=0)
        os.kill(pool.current_lanes[0].process.pid, signal.SIGSTOP)
        pool.publish([list(model.named_parameters())], 1, Digest())
        start = time.monotonic()
        with pytest.raises(RolloutLaneError, match=r"rollout worker 0 .* no heartbeat for .*rollout_max_restarts=0"):
            pool.take(2, consumer_version=1)
        assert time.monotonic() - start < 10
    finally:
        pool.close()
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes))


def test_a_worker_reporting_a_version_the_moment_it_is_visible_is_verified_not_a_mismatch():
    """A fast worker adopts a version as soon as it becomes visible and reports its digest; the trainer must already
    know the digest it published (else a false "digest mismatch" stops training)."""
    from trl_async.records import WeightsAdopted

    pool, model = make_pool(max_staleness=1)
    try:
        publish = pool.backend.publish

        visible_when_recorded = []

        def publish_and_report_at_once(buckets, version, digest=None, ready=None):
            def recorded():
                visible_when_recorded.append(pool.backend.weights.version)
                ready()

            publish(buckets, version, digest, recorded)  # visible to the workers from here on
            pool.lanes._on_adopted(WeightsAdopted(0, version, digest.hexdigest()))  # the report, before we return

        pool.backend.publish = publish_and_report_at_once
        verified = pool.verified_adoptions
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        pool.publish([list(model.named_parameters())], 1, Digest())
        assert pool.verified_adoptions == verified + 1
        assert visible_when_recorded == [0]  # recorded while the workers could still see only version 0
    finally:
        pool.close()


def _never_reads(seconds):
    time.sleep(seconds)


def _never_reading_worker(ctx):
    """A WorkerProcess over a real process that reads nothing from its task pipe (hung), and a chunk that cannot fit
    in the pipe's buffer."""
    from trl_async.engines.transformers.worker_process import WorkerProcess
    from trl_async.records import RolloutTask

    task_recv, task_send = ctx.Pipe(duplex=False)
    result_recv, result_send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_never_reads, args=(60,), daemon=True)
    process.start()
    task_recv.close()
    result_send.close()
    task = RolloutTask(group_id=0, prompt_index=0, prompt_ids=(1,) * 300_000, admitted_at_version=0)
    worker = WorkerProcess(None, process, task_send, result_recv, ctx.Value("d", time.time()))
    worker.outstanding[(0, 0)] = task
    return worker, task


def _sender_of(worker):
    return next(t for t in threading.enumerate() if t.name == f"trl_async-send-{worker.process.pid}")


def test_a_worker_that_reads_nothing_never_holds_up_the_dispatcher():
    """The pool's one dispatcher hands chunks to every worker. A chunk larger than the pipe's buffer waits until the
    worker reads it, and a hung worker reads nothing until the health check kills it: handing it the chunk must
    return at once (its own sender thread waits), or every other worker would get no work meanwhile."""
    import multiprocessing

    worker, task = _never_reading_worker(multiprocessing.get_context("fork"))
    try:
        dispatcher = threading.Thread(target=worker.transmit, args=([task],), daemon=True)
        dispatcher.start()
        dispatcher.join(10.0)
        assert not dispatcher.is_alive(), "transmit blocked on the hung worker's full pipe"
        time.sleep(0.5)
        assert _sender_of(worker).is_alive(), "the chunk fitted in the pipe: the test needs one that blocks"
    finally:
        worker.kill()


def test_chunks_reach_the_worker_in_order_then_the_exit_request():
    import multiprocessing

    from trl_async.engines.transformers.worker_process import WorkerProcess
    from trl_async.records import RolloutTask

    ctx = multiprocessing.get_context("fork")
    task_recv, task_send = ctx.Pipe(duplex=False)
    result_recv, result_send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_echo_group_ids, args=(task_recv, result_send), daemon=True)
    process.start()
    task_recv.close()
    result_send.close()
    worker = WorkerProcess(None, process, task_send, result_recv, ctx.Value("d", time.time()))
    for i in range(5):
        worker.transmit([RolloutTask(group_id=i, prompt_index=i, prompt_ids=(1,) * (100_000 if i == 2 else 3),
                                     admitted_at_version=0)])  # fmt: skip
    worker.stop(30.0)  # asks it to exit after what it was handed
    assert process.exitcode == 0


def _echo_group_ids(tasks, results):
    seen = []
    while (chunk := tasks.recv()) is not None:
        seen.extend(task.group_id for task in chunk)
    sys.exit(0 if seen == [0, 1, 2, 3, 4] else 1)


def test_stopping_a_worker_whose_task_pipe_is_full_kills_it_instead_of_blocking_on_the_pipe():
    """A worker that never reads again (itself blocked sending a large result nobody drains) must still be stopped:
    stop() may not wait for its own exit request, which would queue behind the chunk forever; and the sender thread
    blocked on the full pipe ends when the worker is killed."""
    import multiprocessing

    worker, task = _never_reading_worker(multiprocessing.get_context("fork"))
    worker.transmit([task])
    time.sleep(0.5)
    sender = _sender_of(worker)
    assert sender.is_alive(), "the chunk fitted in the pipe: the test needs one that blocks"
    stopping = threading.Thread(target=worker.stop, args=(0.0,), daemon=True)
    stopping.start()
    stopping.join(5.0)
    alive = stopping.is_alive()
    if alive:  # free the blocked threads before failing
        worker.process.kill()
    assert not alive, "stop() blocked on the full task pipe"
    assert not worker.process.is_alive()
    sender.join(5.0)
    assert not sender.is_alive(), "the blocked send did not end when the worker was killed"
