"""Trainer-side half of the rollout pipeline: worker processes, admission control, scoring, the bounded queue.

Threads in the trainer process (none of them runs a collective or touches the training model):
  * the *dispatcher* hands ``RolloutTask``s to the workers while admission control allows (staleness bound and
    ``queue_size``), taking prompts from the ``PromptStream``;
  * the *collector* receives lane messages and watches the lanes (exits, heartbeats; lanes.py);
  * the *scoring threads* (``scoring_threads``, 1 by default; scoring.py) score each finished group with the reward
    functions, so rewards are ready before the trainer asks for them, and a slow reward never delays the collector.
The trainer's main thread calls ``publish`` (new weights) and ``take`` (the next scored groups; stale ones are dropped,
counted and their prompts re-queued). Every wait is bounded and checks worker health, so a dead worker or a failing
reward function surfaces as an exception on the main thread, never as a hang.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from ..records import RolloutGroup, RolloutTask
from ..weights.shared_memory import Digest
from .admission import AdmissionLedger
from .consumption import next_ready
from .dispatch import later_turn_chunk, pick_lane
from .lanes import Lanes, RolloutLaneError  # noqa: F401 - raised to the trainer
from .prompts import PromptStream
from .readouts import PoolReadouts
from .scored import ScoredGroup, TakeStats, TakeTally
from .scoring import PoolScoring
from .staleness import staleness, trainable

if TYPE_CHECKING:
    from .interfaces import Backend, GroupRunner

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class PoolSettings:
    groups_per_batch: int  # B: groups the trainer consumes per generation batch
    steps_per_batch: int  # k: optimizer steps per generation batch
    max_staleness: int
    queue_size: int  # most groups admitted but not yet consumed
    timeout_s: float
    start_version: int  # trainer version when the pool starts (0, or the resumed global step)
    groups_per_call: int = 1  # most groups handed to a worker at once (one generate call)
    max_restarts: int = 3  # per worker: a lost worker is restarted this many times, then the pool fails
    heartbeat_timeout_s: float = 10.0  # a worker silent this long is hung: killed, then restarted or reported
    scoring_threads: int = 1  # groups scored at once (each on its own thread), off the collector thread
    num_generations: int = 1  # rows per group (a later turn of one episode is one row)
    consumption_window: int | None = None  # None: arrival order; k: admission order within k groups (consumption.py)


class RolloutPool(PoolReadouts, PoolScoring):
    def __init__(
        self,
        backend: Backend,
        settings: PoolSettings,
        prompts: PromptStream,
        read_row: Callable[[int], dict],
        tokenize_row: Callable[[int, dict], tuple[tuple[int, ...], dict]],
        score_group: Callable[[RolloutGroup, dict, list | None], ScoredGroup],
        episodes: Callable[..., GroupRunner] | None = None,
        keep: Callable[[torch.Tensor], bool] | None = None,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """``episodes`` (multi-turn rollouts with tools, or ``rollout_func``): builds the ``GroupRunner`` that turns
        each group's first turn into whole episodes, given ``submit_turn``, ``finished`` and ``fail`` callbacks.
        ``keep`` (dynamic sampling, filtering.py): given a scored group's rewards, whether it may train; a group it
        rejects gives its admission slot back and its prompt counts as consumed (not retried, as DAPO). ``closers``:
        what was started for this pool (a tool runner, reward scorers), closed by ``close`` once its threads have
        stopped."""
        self._closers = list(closers)
        self.settings = settings
        self._prompts = prompts
        self._read_row = read_row
        self._tokenize_row = tokenize_row
        self._score_group = score_group
        self._keep = keep
        self.filtered_groups = 0
        self._tally = TakeTally()  # for the next take's TakeStats
        self.backend = backend
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._error_raised = False  # close() reports an error that no take() raised (it came after the last one)
        self._ledger = AdmissionLedger(
            settings.groups_per_batch,
            settings.steps_per_batch,
            settings.max_staleness,
            settings.queue_size,
            settings.start_version,
        )
        self._next_group_id = 0
        self._positions: dict[int, int] = {}  # group id -> its prompt's stream position (prompts.PromptStream)
        self._rows: dict[int, dict] = {}  # group id -> its dataset row, read once at admission (ScoredGroup.row)
        self._ready: deque[ScoredGroup] = deque()
        self.dropped_samples = 0
        self.dropped_groups = 0
        self.dropped_unscored = 0  # of those, dropped on arrival, before scoring
        # (kind, worker id or -1 for the trainer, start, end) in time.time(): "generate" calls (a continuously
        # batching worker's: one span per distinct group end, nested within a submit), "score" (one group's
        # rewards, on a scoring thread) and the trainer's "wait"s in take(); bounded, for timelines and
        # utilisation (benchmarks/throughput.py)
        self.activity: deque[tuple[str, int, float, float]] = deque(maxlen=100_000)

        self._to_score: queue.SimpleQueue[RolloutGroup] = queue.SimpleQueue()
        self._scoring: dict[int, float] = {}  # group id -> time.monotonic() its reward calls began (for timeouts)
        self._later_turns: deque[RolloutTask] = deque()  # turns of episodes under way: dispatched before new groups
        self.abandoned_groups = 0  # environments: groups whose reset raised
        self._abandoned_in_a_row = 0
        self._episodes = (
            None
            if episodes is None
            else episodes(
                submit_turn=self._submit_turn,
                finished=self._to_score.put,
                fail=self._fail,
                abandon=self._abandon,
                row=self.row,
            )
        )

        self.lanes = Lanes(backend, settings, self._cv, self.activity, self._deliver, self._requeue, self._fail)
        self._threads = [
            threading.Thread(target=self._guard(self._dispatch_loop), name="trl_async-dispatch", daemon=True),
            threading.Thread(target=self._guard(self._collect_loop), name="trl_async-collect", daemon=True),
        ] + [
            threading.Thread(target=self._guard(self._score_loop), name=f"trl_async-score-{i}", daemon=True)
            for i in range(settings.scoring_threads)
        ]

    def start(self) -> RolloutPool:
        """Start the lanes (``Backend.start_lane``, one per spec) and the pool's threads: dispatch, collect, scoring.
        Nothing runs before this; ``close`` stops what it started."""
        if self._episodes is not None:
            self._episodes.open()
        try:
            self.lanes.start()
            for t in self._threads:
                t.start()
        except BaseException:
            if self._episodes is not None:  # its thread would wait for events forever, holding its environments
                self._episodes.close()
            raise
        return self

    # ---- main thread -------------------------------------------------------------------------------------------
    def publish_base(
        self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]], version: int, digest: Digest | None = None
    ) -> None:
        """Adapter-only LoRA sync: the frozen rest of the model, once (and again for a server that came back)."""
        self.backend.publish_base(buckets, version, digest)

    def publish(
        self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]], version: int, digest: Digest | None = None
    ) -> float:
        """Make the streamed tensors the weights of ``version`` (see ``SharedMemoryWeights.publish``); lanes adopt
        them at their next safe point. ``digest`` (``rollout_verify_weights``): filled from the stream, what every lane
        must report adopting. Returns the seconds it took."""
        start = time.perf_counter()
        # the digest is recorded before the version becomes visible: a fast worker may report adopting it at once
        ready = None if digest is None else (lambda: self.lanes.expect_digest(version, digest.hexdigest()))
        self.backend.publish(buckets, version, digest, ready)
        with self._cv:
            self._ledger.published = version
            self._cv.notify_all()
        return time.perf_counter() - start

    def take(self, n: int, consumer_version: int) -> tuple[list[ScoredGroup], TakeStats] | None:
        """Block until ``n`` fresh scored groups are ready and return them (oldest first). ``None``: nothing can come
        until the weights are published again (a vLLM server came back while no other worked: it is re-attached at
        a weight sync); the trainer publishes and takes again."""
        start, started_at = time.perf_counter(), time.time()
        deadline = start + self.settings.timeout_s
        taken: list[ScoredGroup] = []
        with self._cv:
            queue_size = len(self._ready)
            filtered_seen = self.filtered_groups
            while len(taken) < n:
                self._raise_if_failed()
                if self.filtered_groups != filtered_seen:  # dynamic sampling: groups are still being generated
                    filtered_seen, deadline = self.filtered_groups, time.perf_counter() + self.settings.timeout_s
                while len(taken) < n and (i := self._next_ready(taken)) is not None:
                    scored = self._ready[i]
                    del self._ready[i]
                    versions = scored.group.token_versions
                    if not trainable(consumer_version, versions, self.settings.max_staleness):  # the guarantee
                        self._drop_stale(scored.group)
                        continue
                    taken.append(replace(scored, staleness=staleness(consumer_version, versions)))
                if len(taken) == n:
                    break
                if self.backend.resync_wanted:
                    self._ready.extendleft(reversed(taken))  # back in front, in order (staleness worked out again)
                    return None
                if time.perf_counter() > deadline:
                    raise self._take_timeout(n - len(taken), consumer_version)
                self._cv.wait(timeout=0.2)
            self._ledger.consume(n)
            self._prompts.taken([self._forget(g.group.group_id) for g in taken], consumer_version)
            self._cv.notify_all()
            now = time.perf_counter()
            stats = self._tally.close(
                taken,
                now,
                queue_size=queue_size,
                wait_s=now - start,
                dropped_samples_total=self.dropped_samples,
                filtered_groups_total=self.filtered_groups if self._keep is not None else None,
                lanes_healthy=sum(w.is_alive() and w.max_outstanding > 0 for w in self.lanes.current),
            )
        self.activity.append(("wait", -1, started_at, started_at + (now - start)))
        return taken, stats

    def prompt_progress(self, done_up_to_version: int) -> dict:
        """Which prompts training has completed (see ``PromptStream.progress``), for a checkpoint."""
        with self._cv:
            return self._prompts.progress(done_up_to_version)

    def row(self, group_id: int) -> dict:
        """The dataset row of an admitted group, as read at admission (episode and rollout_func runners start from
        it)."""
        with self._cv:
            return self._rows[group_id]

    def _next_ready(self, taken: list[ScoredGroup]) -> int | None:
        """Where in ``_ready`` the next group to take is (consumption.py), or None to wait (caller holds the lock)."""
        if self.settings.consumption_window is None or not self._ready:
            return 0 if self._ready else None
        pending = self._positions.keys() - {g.group.group_id for g in taken}
        return next_ready([g.group.group_id for g in self._ready], pending, self.settings.consumption_window)

    def _forget(self, group_id: int) -> int:
        """A group leaves the pool (trained, dropped, abandoned or requeued; caller holds the lock): its stream
        position."""
        self._rows.pop(group_id, None)
        return self._positions.pop(group_id)

    def _drop_stale(self, group: RolloutGroup) -> None:
        """Never train on ``group``; generate its prompt again (caller holds the lock)."""
        self._ledger.give_back()
        self.dropped_groups += 1
        self.dropped_samples += len(group.completion_ids)
        self._prompts.push_front(self._forget(group.group_id), group.prompt_index)
        if self._episodes is not None:
            self._episodes.release(group.group_id)
        self._cv.notify_all()

    def close(self, timeout_s: float = 0.5) -> None:
        """Stop threads and workers; every worker process is joined. A worker holding groups (inside a generate call,
        or about to be) is killed at once: nothing it would still send is used, and waiting for the call (2-3 s at the
        end of every ``train`` on the real model) bought nothing. An idle worker is asked to exit, and killed after
        ``timeout_s``. An error no ``take`` raised (it came after the last one) is logged; one that closing itself
        causes (a pipe closed under a send) is not."""
        with self._cv:
            self._stop = True
            unreported = None if self._error_raised else self._error
            self._cv.notify_all()
        for t in self._threads:  # the collector stops reading; workers blocked on a full pipe are killed below
            if t.is_alive():
                t.join(5)
        if self._episodes is not None:
            self._episodes.close()
        self.lanes.stop(timeout_s)
        self.backend.close()
        for close in self._closers:  # after the threads and the episode runner that used them
            close()
        if unreported is not None:
            logger.warning("rollouts failed after the last batch was taken (nothing trained on it): %r", unreported)

    # ---- background threads ------------------------------------------------------------------------------------
    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by take()
                with self._cv:
                    self._error = self._error or exc
                    self._cv.notify_all()

        return run

    def _dispatch_loop(self) -> None:
        """Admit groups as admission control allows and hand them to the workers in chunks of up to
        ``groups_per_call`` (one task message per generate call: a worker handed single groups as they were admitted
        would start a generate call per group, several times slower per group on CPU). A lane holds at most its
        ``max_outstanding`` groups (a worker process: two chunks, the one it generates and the next; a vLLM server:
        the queue size), so each lane's outstanding groups are known exactly."""
        per_call, rows_per_group = self.settings.groups_per_call, self.settings.num_generations
        handed: dict[int, int] = {}  # id(lane) -> the number of its last chunk (dispatch.pick_lane)
        chunks = itertools.count()

        def free_worker():
            return pick_lane(self.lanes.current, per_call, rows_per_group, handed)

        def ready() -> bool:  # (an iterable dataset's reader may lag behind: prompts available)
            new = self._ledger.room() > 0 and self._prompts.available() > 0
            return bool(self._stop or self._error or ((self._later_turns or new) and free_worker() is not None))

        while True:
            with self._cv:  # the reader does not notify this condition: poll for it
                if not self._cv.wait_for(ready, timeout=self._prompts.poll_s):
                    continue
                if self._stop or self._error:
                    return
                worker = free_worker()
                if self._later_turns:  # finish episodes under way first: up to one call's rows of later turns
                    chunk = later_turn_chunk(self._later_turns, per_call * rows_per_group)
                else:
                    n = min(per_call, self._ledger.room(), self._prompts.available())
                    self._ledger.admit(n)
                    version = self._ledger.published
                    chunk = []
                    starts = self._episodes is not None and self._episodes.starts_groups
                    for _ in range(n):
                        position, index = self._prompts.next()
                        self._positions[self._next_group_id] = position
                        row = self._rows[self._next_group_id] = self._read_row(index)
                        # environments: the runner renders each episode's prompt itself
                        prompt_ids, images = ((), {}) if starts else self._tokenize_row(index, row)
                        chunk.append(RolloutTask(self._next_group_id, index, prompt_ids, version, images=images))
                        self._next_group_id += 1
                    if starts:  # environments: reset first; the first turn then comes back as a later turn
                        for task in chunk:
                            self._episodes.start(task)
                        continue
                worker.register(chunk)
                handed[id(worker)] = next(chunks)
            self._transmit(worker, chunk)  # outside the lock

    @staticmethod
    def _transmit(worker, chunk: list[RolloutTask]) -> None:
        try:  # registered under the lock, piped outside it (a chunk of long contexts may wait for the worker)
            worker.transmit(chunk)
        except OSError:  # the worker is gone; the monitor regenerates what it held
            pass
        except TypeError:  # also what a send raises when the connection is closed under it (the worker was killed)
            if not getattr(getattr(worker, "tasks", None), "closed", False):
                raise

    def _submit_turn(self, task: RolloutTask) -> None:
        """The ``EpisodeRunner`` asks for the next turn of an episode."""
        with self._cv:
            self._later_turns.append(task)
            self._cv.notify_all()

    def _abandon(self, task: RolloutTask, why: str, streak: bool = True) -> None:
        """A group that cannot run or be scored (its environment's ``reset`` raised, a timed-out tool call never
        returned, a ``rollout_func`` gave it up): skipped, counted, its prompt not retried. ``streak``: counts
        towards the groups-in-a-row limit (an agent that fails now and then gives groups up by chance: ``False``;
        one that always fails leaves ``take`` waiting until ``rollout_timeout_s``)."""
        logger.warning("train_dataset row %d: skipped, %s", task.prompt_index, why)
        with self._cv:
            self._ledger.give_back()
            self.abandoned_groups += 1
            self._abandoned_in_a_row += 1 if streak else 0
            # done as far as resuming is concerned, whatever the checkpoint's step
            self._prompts.taken([self._forget(task.group_id)], -(2**62))
            limit = 2 * self.settings.groups_per_batch + 2
            if self._abandoned_in_a_row >= limit:  # a reset that always raises: stop, not spin through the data
                self._error = self._error or RuntimeError(
                    f"{self._abandoned_in_a_row} groups in a row could not run; the last one (train_dataset row "
                    f"{task.prompt_index}): {why}"
                )
            self._cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()

    def _collect_loop(self) -> None:
        """Receive lane messages (finished groups go to the episode runner or the scoring threads) and watch the
        lanes (exit, heartbeat)."""
        while not self._stop:
            self.lanes.poll(lambda: self._stop)

    def _deliver(self, group: RolloutGroup, task: RolloutTask) -> None:
        if self._episodes is not None:  # a turn of multi-turn episodes: the runner decides what comes next
            self._episodes.on_turn(group, task.admitted_at_version)
        else:
            self._to_score.put(group)  # scored off this thread: a slow reward never delays health checks

    def _requeue(self, first_turns: list[RolloutTask], later_turns: list[RolloutTask]) -> None:
        """What a lost lane held (caller holds the lock): first turns back to admission, their prompts first in
        line; later turns of episodes under way generated again from the same context (the episode keeps its
        tools' results), first in line."""
        for task in reversed(first_turns):
            self._prompts.push_front(self._forget(task.group_id), task.prompt_index)
        self._ledger.give_back(len(first_turns))
        self._later_turns.extendleft(reversed(later_turns))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error
