"""What the pool needs from the parts it is given, written down: a ``Backend`` (worker processes or vLLM servers)
starts ``Lane``s and takes the published weights; a ``GroupRunner`` (multi-turn episodes, or ``rollout_func``) turns
admitted groups into finished ones. The pool imports nothing of the engines (an import-linter contract checks it) and
uses of them what these declare; tests/unit/test_pool_fake_backend.py drives the pool with in-process fakes of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from ..records import RolloutGroup, RolloutTask


class Lane(Protocol):
    """One generator: a worker process, or a vLLM server. It holds what it was handed until it returns it."""

    lane_id: int
    outstanding: dict[tuple, RolloutTask]  # every task handed to it and not yet returned, in dispatch order
    max_outstanding: int  # groups it may hold at once (0: it takes no work, e.g. a lost server)
    restarts: int  # how many times its index was started again after a loss (``Backend.start_lane``)
    # the receiving end of what it sends back (groups, adopted weights, failures, readiness): a pipe the collector
    # waits on with ``multiprocessing.connection.wait`` beside the other lanes'
    results: Connection

    def register(self, chunk: list[RolloutTask]) -> None:
        """Record a chunk as outstanding (under the pool's lock), before ``transmit``."""

    def transmit(self, chunk: list[RolloutTask]) -> None:
        """Hand a registered chunk to the generator (outside the pool's lock: it may block on a full pipe)."""

    def is_alive(self) -> bool: ...

    def exit_reason(self) -> str:
        """Why it is gone, for the error the pool raises."""

    def describe(self) -> str: ...

    def silent_for(self, now: float) -> float:
        """Seconds since it last sent anything (its heartbeat included)."""

    def stop(self, timeout_s: float) -> None:
        """Ask it to finish, and kill it after ``timeout_s``."""

    def kill(self) -> None: ...


class Backend(Protocol):
    """The engine behind the pool's lanes, and where published weights go."""

    restartable: bool  # a lost lane may be started again
    resync_wanted: bool  # a restarted lane needs a publish before it can generate
    restart_note: str  # what the restart log line says happens next
    adapter_blocker: str | None  # adapter-only LoRA sync: why this backend cannot take the adapters (None: it can)
    needs_base: bool  # adapter-only LoRA sync: a lane that came back must get the frozen base again
    specs: Sequence[Any]  # one per lane: what ``start_lane(index)`` starts

    def start_lane(self, index: int, restarts: int = 0) -> Lane: ...

    @property
    def base_target(self) -> Any:
        """Where ``publish_base`` writes (adapter-only LoRA sync: the frozen base, once)."""

    @property
    def publish_target(self) -> Any:
        """Where ``publish`` writes each version."""

    def publish_base(self, buckets, version: int, digest=None) -> None: ...

    def publish(self, buckets, version: int, digest=None, ready: Callable[[], None] | None = None) -> None: ...

    def close(self) -> None: ...


class GroupRunner(Protocol):
    """Turns admitted groups into finished ones over several generation turns, on its own thread(s)."""

    starts_groups: bool  # it starts each admitted group itself (``start``) instead of the pool's first turn

    def open(self) -> None:
        """Start its thread(s): nothing runs before this (the pool's ``start``); ``close`` stops them."""

    def start(self, task: RolloutTask) -> None: ...

    def on_turn(self, turn: RolloutGroup, admitted_at_version: int) -> None:
        """A generated turn of one of its groups, from the pool's collector."""

    def instances(self, group_id: int) -> list | None:
        """The environment instances of a finished group, until ``release`` (None: it has none)."""

    def release(self, group_id: int) -> None: ...

    def close(self, timeout_s: float = 5.0) -> None: ...
