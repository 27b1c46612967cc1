"""Trainer-side half of the rollout pipeline: worker processes, admission control, scoring, the bounded queue.

Threads in the trainer process (none of them runs a collective or touches the training model):
  * the *dispatcher* hands ``RolloutTask``s to the workers while admission control allows (staleness bound and
    ``queue_size``), taking prompts from the ``PromptStream``;
  * the *collector* receives worker messages and scores each finished group with the reward functions, so rewards are
    ready before the trainer asks for them.
The trainer's main thread calls ``publish`` (new weights) and ``take`` (the next scored groups; stale ones are dropped,
counted and their prompts re-queued). Every wait is bounded and checks worker health, so a dead worker or a failing
reward function surfaces as an exception on the main thread, never as a hang.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from queue import Empty

import torch

from .prompts import PromptStream
from .records import RolloutGroup, RolloutTask, WeightsAdopted, WorkerFailed, WorkerReady
from .staleness import max_groups_admitted, staleness
from .weights import Digest, SharedMemoryWeights
from .worker import WorkerSpec, worker_main


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, failed or sent weights that differ from what the trainer published."""


@dataclass(frozen=True, slots=True)
class ScoredGroup:
    group: RolloutGroup
    staleness: int = 0
    rewards: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (num_generations, num_reward_funcs)
    extra_logs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PoolSettings:
    groups_per_batch: int  # B: groups the trainer consumes per generation batch
    steps_per_batch: int  # k: optimizer steps per generation batch
    max_staleness: int
    queue_size: int  # most groups admitted but not yet consumed
    timeout_s: float
    start_version: int  # trainer version when the pool starts (0, or the resumed global step)
    verify_weights: bool
    groups_per_call: int = 1  # most groups handed to a worker at once (one generate call)


@dataclass
class TakeStats:
    """What one ``take`` observed; the trainer logs it under ``async/``."""

    staleness: list[int]
    queue_size: int
    wait_s: float
    dropped_samples_total: int
    gen_tokens_per_s: float


@contextlib.contextmanager
def _no_main_reimport():
    """Spawned children re-import the parent's ``__main__`` by default, which re-runs an unguarded user script (no
    ``if __name__ == "__main__"``). Workers need nothing from ``__main__``, so hide it while starting them."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class RolloutPool:
    def __init__(
        self,
        specs: list[WorkerSpec],
        weight_specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
        settings: PoolSettings,
        prompts: PromptStream,
        tokenize_row: Callable[[int], tuple[int, ...]],
        score_group: Callable[[RolloutGroup], ScoredGroup],
    ) -> None:
        self.settings = settings
        self._prompts = prompts
        self._tokenize_row = tokenize_row
        self._score_group = score_group
        self._ctx = torch.multiprocessing.get_context("spawn")
        self._weights = SharedMemoryWeights(weight_specs, self._ctx)
        self._task_queue = self._ctx.Queue()
        self._result_queue = self._ctx.Queue()
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._published: int | None = None  # nothing is admitted before the first publish
        self._admitted = 0  # groups dispatched and not dropped
        self._consumed = 0
        self._next_group_id = 0
        self._ready: deque[ScoredGroup] = deque()
        self._expected_digests: dict[int, str] = {}
        self.dropped_samples = 0
        self.dropped_groups = 0
        self.verified_adoptions = 0
        self.worker_versions: dict[int, int] = {}
        self._tokens_since_take = 0
        self._last_take_end = time.perf_counter()
        # (kind, worker id or -1 for the trainer, start, end) in time.time(): "generate" calls, "score" (one group's
        # rewards, on the collector thread) and the trainer's "wait"s in take(); bounded, for timelines and
        # utilisation (benchmarks/throughput.py)
        self.activity: deque[tuple[str, int, float, float]] = deque(maxlen=100_000)
        self._last_call: dict[int, float] = {}

        self._processes = []
        with _no_main_reimport():
            for spec in specs:
                proc = self._ctx.Process(
                    target=worker_main,
                    args=(spec, self._weights, self._task_queue, self._result_queue),
                    name=f"trl_async-rollout-{spec.worker_id}",
                    daemon=True,
                )
                proc.start()
                self._processes.append(proc)
        self._threads = [
            threading.Thread(target=self._guard(self._dispatch_loop), name="trl_async-dispatch", daemon=True),
            threading.Thread(target=self._guard(self._collect_loop), name="trl_async-collect", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- main thread -------------------------------------------------------------------------------------------
    @property
    def publish_target(self) -> dict[str, torch.Tensor]:
        """Where the next ``publish`` writes (see ``SharedMemoryWeights.spare_tensors``)."""
        return self._weights.spare_tensors

    def publish(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]], version: int) -> float:
        """Make the streamed tensors the weights of ``version`` (see ``SharedMemoryWeights.publish``); workers adopt
        them at their next safe point. Returns the seconds it took."""
        start = time.perf_counter()
        digest = Digest() if self.settings.verify_weights else None
        self._weights.publish(buckets, version, digest)
        if digest is not None:
            self._expected_digests[version] = digest.hexdigest()
            for old in [v for v in self._expected_digests if v < version - 64]:  # bounded history
                del self._expected_digests[old]
        with self._cv:
            self._published = version
            self._cv.notify_all()
        return time.perf_counter() - start

    def take(self, n: int, consumer_version: int) -> tuple[list[ScoredGroup], TakeStats]:
        """Block until ``n`` fresh scored groups are ready and return them (oldest first)."""
        start, started_at = time.perf_counter(), time.time()
        deadline = start + self.settings.timeout_s
        taken: list[ScoredGroup] = []
        with self._cv:
            queue_size = len(self._ready)
            while len(taken) < n:
                self._raise_if_failed()
                while self._ready and len(taken) < n:
                    scored = self._ready.popleft()
                    s = staleness(consumer_version, scored.group.token_versions)
                    if s > self.settings.max_staleness:  # never train on it; generate its prompt again
                        self._admitted -= 1
                        self.dropped_groups += 1
                        self.dropped_samples += len(scored.group.completion_ids)
                        self._prompts.push_front(scored.group.prompt_index)
                        self._cv.notify_all()
                        continue
                    taken.append(replace(scored, staleness=s))
                if len(taken) == n:
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"waited {self.settings.timeout_s:.0f}s (rollout_timeout_s) for {n - len(taken)} more rollout "
                        f"groups at trainer version {consumer_version}; published version {self._published}, "
                        f"admitted {self._admitted}, consumed {self._consumed}, worker versions "
                        f"{self.worker_versions}, workers alive {[p.is_alive() for p in self._processes]}"
                    )
                self._cv.wait(timeout=0.2)
            self._consumed += n
            self._cv.notify_all()
            now = time.perf_counter()
            tokens, self._tokens_since_take = self._tokens_since_take, 0
            rate = tokens / max(now - self._last_take_end, 1e-9)
            self._last_take_end = now
        self.activity.append(("wait", -1, started_at, started_at + (now - start)))
        stats = TakeStats(
            staleness=[g.staleness for g in taken for _ in g.group.completion_ids],
            queue_size=queue_size,
            wait_s=now - start,
            dropped_samples_total=self.dropped_samples,
            gen_tokens_per_s=rate,
        )
        return taken, stats

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop threads and workers; every worker process is joined (killed if it does not stop in time)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for _ in self._processes:
            with contextlib.suppress(Exception):
                self._task_queue.put(None)
        deadline = time.monotonic() + timeout_s
        for proc in self._processes:  # the collector keeps draining results meanwhile, so no worker blocks on put
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(5)
        for q in (self._task_queue, self._result_queue):
            q.cancel_join_thread()
            q.close()

    @property
    def processes(self) -> list:
        return list(self._processes)

    @property
    def admitted(self) -> int:
        """Groups dispatched to workers so far, not counting dropped ones."""
        with self._cv:
            return self._admitted

    @property
    def ready_count(self) -> int:
        """Scored groups waiting for the trainer."""
        with self._cv:
            return len(self._ready)

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

    def _admission_limit(self) -> int:
        s = self.settings
        if self._published is None:
            return 0
        by_staleness = max_groups_admitted(
            self._published,
            s.max_staleness,
            s.groups_per_batch,
            s.steps_per_batch,
            s.start_version // s.steps_per_batch,
        )
        return min(by_staleness, self._consumed + s.queue_size)

    def _dispatch_loop(self) -> None:
        """Admit groups as admission control allows and hand them to the workers in chunks of up to
        ``groups_per_call`` (one task message per generate call: a worker handed single groups as they were admitted
        would start a generate call per group, several times slower per group on CPU)."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._error or self._admitted < self._admission_limit())
                if self._stop or self._error:
                    return
                n = min(self.settings.groups_per_call, self._admission_limit() - self._admitted)
                self._admitted += n
                group_ids, version = range(self._next_group_id, self._next_group_id + n), self._published
                self._next_group_id += n
            chunk = []
            for group_id in group_ids:
                index = self._prompts.next_index()
                chunk.append(RolloutTask(group_id, index, self._tokenize_row(index), version))
            self._task_queue.put(chunk)

    def _collect_loop(self) -> None:
        while True:
            try:
                msg = self._result_queue.get(timeout=0.1)
            except Empty:
                if self._stop and not any(p.is_alive() for p in self._processes):
                    return
                continue
            if isinstance(msg, RolloutGroup):
                if self._last_call.get(msg.worker_id) != msg.generate_started_at:  # one entry per call, not group
                    self._last_call[msg.worker_id] = msg.generate_started_at
                    end = msg.generate_started_at + msg.generate_s
                    self.activity.append(("generate", msg.worker_id, msg.generate_started_at, end))
                scoring_started = time.time()
                scored = self._score_group(msg)
                self.activity.append(("score", msg.worker_id, scoring_started, time.time()))
                with self._cv:
                    self._ready.append(scored)
                    self._tokens_since_take += msg.num_tokens
                    self._cv.notify_all()
            elif isinstance(msg, WeightsAdopted):
                self._on_adopted(msg)
            elif isinstance(msg, WorkerFailed):
                raise RolloutWorkerError(f"rollout worker {msg.worker_id} failed:\n{msg.error}")
            elif isinstance(msg, WorkerReady):
                pass

    def _on_adopted(self, msg: WeightsAdopted) -> None:
        with self._cv:
            self.worker_versions[msg.worker_id] = msg.version
        if msg.digest is not None:
            expected = self._expected_digests.get(msg.version)
            if expected != msg.digest:
                raise RolloutWorkerError(
                    f"rollout worker {msg.worker_id} holds weights for version {msg.version} that differ from the "
                    "weights the trainer published (digest mismatch)"
                )
            self.verified_adoptions += 1

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        for i, proc in enumerate(self._processes):
            if not proc.is_alive() and not self._stop:
                # give the collector a moment to deliver the worker's own report, which is more useful
                self._cv.wait(timeout=1.0)
                if self._error is not None:
                    raise self._error
                raise RolloutWorkerError(f"rollout worker {i} (pid {proc.pid}) exited with code {proc.exitcode}")
