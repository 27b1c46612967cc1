"""The rollout pool driven through its Protocols alone (rollout/interfaces.py), with an in-process fake backend: no
processes, no model. Admission, the staleness guarantee at take, a lost lane's groups generated again by its
replacement, and the pool failing once restarts are used up."""

import threading
import time
from dataclasses import dataclass, field
from multiprocessing import Pipe

import pytest
import torch

from trl_async.records import RolloutGroup, RolloutTask, WeightsAdopted
from trl_async.rollout.interfaces import Backend, Lane
from trl_async.rollout.pool import PoolSettings, RolloutLaneError, RolloutPool
from trl_async.rollout.prompts import PromptStream
from trl_async.rollout.scored import ScoredGroup

G = 2  # completions per group


@dataclass
class FakeLane:
    """Answers each task at once with completions tagged with the backend's newest version, unless ``holding``:
    then it keeps what it is handed (a lane mid-generation). ``dead``: its process is gone."""

    lane_id: int
    backend: "FakeBackend"
    restarts: int = 0
    max_outstanding: int = 4
    outstanding: dict = field(default_factory=dict)
    holding: bool = False
    dead: bool = False
    results: object = field(init=False)  # the pool's end of the lane's pipe

    def __post_init__(self) -> None:
        self.results, self._outbox = Pipe(duplex=False)

    def register(self, chunk: list[RolloutTask]) -> None:
        for task in chunk:
            self.outstanding[task.key] = task

    def transmit(self, chunk: list[RolloutTask]) -> None:
        if self.holding or self.dead:
            return
        version = self.backend.version
        for task in chunk:
            self.backend.generated.append((self.lane_id, task.prompt_index, version))
            completions = tuple((100 + task.prompt_index, 1) for _ in range(G))
            self._outbox.send(
                RolloutGroup(
                    task.group_id,
                    task.prompt_index,
                    task.prompt_ids,
                    completions,
                    tuple((-0.5, -0.5) for _ in range(G)),
                    tuple((version, version) for _ in range(G)),
                    self.lane_id,
                    generate_s=0.0,
                )  # fmt: skip
            )

    def is_alive(self) -> bool:
        return not self.dead

    def exit_reason(self) -> str:
        return "exited (planted)"

    def describe(self) -> str:
        return f"fake lane {self.lane_id}"

    def silent_for(self, now: float) -> float:
        return 0.0

    def stop(self, timeout_s: float) -> None:
        self.dead = True

    def kill(self) -> None:
        self.dead = True


@dataclass
class FakeBackend:
    lanes: int = 1
    restartable: bool = True
    resync_wanted: bool = False
    restart_note: str = "restarted (fake)"
    adapter_blocker: str | None = None
    needs_base: bool = False
    version: int = -1
    started: list = field(default_factory=list)
    generated: list = field(default_factory=list)  # (lane, prompt, version) of every group generated
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def specs(self) -> list:
        return [None] * self.lanes

    def start_lane(self, index: int, restarts: int = 0) -> FakeLane:
        lane = FakeLane(index, self, restarts=restarts)
        self.started.append(lane)
        return lane

    base_target = None
    publish_target = None

    def publish_base(self, buckets, version: int, digest=None) -> None:
        raise AssertionError("no adapter-only sync here")

    def publish(self, buckets, version: int, digest=None, ready=None) -> None:
        for _ in buckets:
            pass
        self.version = version
        for lane in self.started:  # every live lane adopts at once, as a worker reports it
            if not lane.dead:
                lane._outbox.send(WeightsAdopted(lane.lane_id, version, None))
        if ready is not None:
            ready()

    def close(self) -> None:
        pass


def test_the_fakes_are_the_protocols():
    """The pool's contract, checked structurally: what the fakes implement is what the Protocols declare."""
    for fake, protocol in ((FakeLane, Lane), (FakeBackend, Backend)):
        declared = {n for n in dir(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
        assert declared <= set(dir(fake)) | set(fake.__dataclass_fields__), (protocol, declared - set(dir(fake)))


def make_pool(backend, max_staleness, groups_per_batch=2, queue_size=None, max_restarts=1, rows=16):
    settings = PoolSettings(
        groups_per_batch=groups_per_batch, steps_per_batch=1, max_staleness=max_staleness,
        queue_size=queue_size or (max_staleness + 1) * groups_per_batch, timeout_s=10, start_version=0,
        max_restarts=max_restarts, num_generations=G,
    )  # fmt: skip
    prompts = PromptStream(rows, groups_per_batch, shuffle=False, seed=0)
    score = lambda g, row, environments=None: ScoredGroup(g, rewards=torch.zeros(G, 1))  # noqa: E731
    return RolloutPool(backend, settings, prompts, lambda i: {"i": i}, lambda i, row: ((1, 2, i), {}), score).start()


def test_a_pool_starts_nothing_until_started():
    backend = FakeBackend()
    settings = PoolSettings(groups_per_batch=2, steps_per_batch=1, max_staleness=0, queue_size=2, timeout_s=10,
                            start_version=0, num_generations=G)  # fmt: skip
    prompts = PromptStream(16, 2, shuffle=False, seed=0)
    before = set(threading.enumerate())
    pool = RolloutPool(
        backend, settings, prompts, lambda i: {}, lambda i, row: ((1,), {}), lambda g, row, e=None: None
    )
    assert backend.started == [] and pool.lanes.current == [] and set(threading.enumerate()) <= before
    pool.start()
    try:
        assert len(backend.started) == 1 and {"trl_async-dispatch", "trl_async-collect"} <= {
            t.name for t in threading.enumerate()
        }
    finally:
        pool.close()
    pool.close()  # closing again is harmless


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_admission_alternates_with_training_at_max_staleness_0():
    backend = FakeBackend()
    pool = make_pool(backend, max_staleness=0)
    try:
        time.sleep(0.1)
        assert backend.generated == []  # nothing published: nothing may start
        pool.publish([[]], 0)
        groups, stats = pool.take(2, consumer_version=0)
        assert [g.group.prompt_index for g in groups] == [0, 1] and stats.staleness == [0] * (2 * G)
        time.sleep(0.1)
        assert len(backend.generated) == 2  # the next batch would be consumed at version 1, not yet published
        pool.publish([[]], 1)
        groups, _ = pool.take(2, consumer_version=1)
        assert [(lane, prompt, v) for lane, prompt, v in backend.generated] == [
            (0, 0, 0),
            (0, 1, 0),
            (0, 2, 1),
            (0, 3, 1),
        ]
    finally:
        pool.close()


def test_no_group_older_than_max_staleness_trains():
    """Groups generated at version 0 wait while the trainer publishes 1, 2, 3 without taking; taken at 3 with
    max_staleness 1 they are dropped (or never scored) and their prompts generated again, at version 3."""
    backend = FakeBackend()
    pool = make_pool(backend, max_staleness=1)
    try:
        pool.publish([[]], 0)
        wait_until(lambda: len(backend.generated) == 4)  # (max_staleness + 1) batches of 2 groups: the queue is full
        for version in (1, 2, 3):
            pool.publish([[]], version)
        groups, stats = pool.take(2, consumer_version=3)
        assert max(stats.staleness) <= 1 and all(min(g.group.token_versions) >= 2 for g in groups)
        assert {g.group.prompt_index for g in groups} <= {0, 1, 2, 3}  # the dropped prompts come back first
        assert pool.dropped_groups >= 2 and stats.dropped_samples_total == G * pool.dropped_groups
    finally:
        pool.close()


def test_a_lost_lane_is_restarted_and_its_groups_generated_again():
    backend = FakeBackend()
    pool = make_pool(backend, max_staleness=0, max_restarts=1)
    try:
        backend.started[0].holding = True  # it takes the first batch and never answers
        pool.publish([[]], 0)
        wait_until(lambda: len(backend.started[0].outstanding) == 2)
        backend.started[0].dead = True
        groups, _ = pool.take(2, consumer_version=0)
        assert [g.group.prompt_index for g in groups] == [0, 1] and {g.group.lane_id for g in groups} == {0}
        assert len(backend.started) == 2 and backend.started[1].restarts == 1 and pool.lane_restarts == 1
        assert pool.lost_lanes == ["fake lane 0 exited (planted)"]
    finally:
        pool.close()


def test_the_pool_fails_once_restarts_are_used_up():
    backend = FakeBackend()
    pool = make_pool(backend, max_staleness=0, max_restarts=0)
    try:
        backend.started[0].holding = True
        pool.publish([[]], 0)
        wait_until(lambda: len(backend.started[0].outstanding) == 2)
        backend.started[0].dead = True
        with pytest.raises(RolloutLaneError, match=r"fake lane 0 exited \(planted\); it was already restarted 0"):
            pool.take(2, consumer_version=0)
    finally:
        pool.close()
