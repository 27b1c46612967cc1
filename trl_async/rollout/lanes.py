"""The pool's generation lanes (worker processes, or vLLM servers): started, watched, restarted, and their messages
routed. One ``Lanes`` belongs to one ``RolloutPool`` and shares its lock; the pool's collector thread calls
``poll`` in a loop.

A lane that exits, or sends no heartbeat for ``heartbeat_timeout_s``, is lost: killed, what it held handed back to
the pool (``requeue``: first turns go back to admission, later turns of episodes are generated again from the same
context), and restarted with the newest weights (a vLLM server's lane waits for the server to come back and is
re-attached: engines/vllm/weight_push/recovery.py), up to ``max_restarts`` times; after that, the pool fails with the reason. A
lane's report of adopted weights is checked against the digest of what was published (``rollout_verify_weights``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_messages

from transformers.utils import logging

from ..records import LaneFailed, RolloutGroup, RolloutTask, WeightsAdopted, WorkerReady

logger = logging.get_logger(__name__)


class RolloutLaneError(RuntimeError):
    """A rollout lane (a transformers worker process, or a vLLM server) died, failed, or reports weights that differ
    from what the trainer published; the message names the lane and why."""


class Lanes:
    def __init__(
        self,
        backend,
        settings,
        cv: threading.Condition,
        activity: deque,
        deliver: Callable[[RolloutGroup, RolloutTask], None],
        requeue: Callable[[list[RolloutTask], list[RolloutTask]], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        """``deliver(group, task)``: a lane returned ``task``; ``requeue(first_turns, later_turns)`` (called with
        the lock held): what a lost lane held; ``fail``: the pool fails with this error."""
        self.backend, self.settings, self._cv, self.activity = backend, settings, cv, activity
        self._deliver, self._requeue, self._fail = deliver, requeue, fail
        self.current: list = []  # one per spec once started; a lost lane's replacement takes its place
        self.lane_versions: dict[int, int] = {}  # lane id -> the version it reported adopting last
        self.lane_restarts = 0
        self.lost_lanes: list[str] = []  # why each lost lane was lost
        self.placement: dict[int, tuple[tuple[int, ...], int]] = {}  # worker process -> (its cores, torch threads)
        self.verified_adoptions = 0
        self._expected_digests: dict[int, str] = {}
        self._last_call: dict[int, tuple[float, float]] = {}  # lane -> (start, seconds) of its newest span

    def start(self) -> None:
        """Start one lane per spec of the backend."""
        self.current = [self.backend.start_lane(i) for i in range(len(self.backend.specs))]

    def expect_digest(self, version: int, digest: str) -> None:
        """The digest of the weights published as ``version`` (what lanes must report adopting)."""
        self._expected_digests[version] = digest
        for old in [v for v in self._expected_digests if v < version - 64]:  # bounded history
            del self._expected_digests[old]

    def poll(self, stopped: Callable[[], bool]) -> None:
        """One round of the collector: handle waiting messages (up to 0.1 s), then check every lane's health."""
        by_conn = {w.results: w for w in self.current}
        for conn in wait_for_messages(list(by_conn), timeout=0.1):
            self._drain(by_conn[conn])
        now = time.time()
        for i, w in enumerate(self.current):
            if stopped():
                return
            if not w.is_alive():
                self._drain(w)  # a LaneFailed report raises here, before any restart
                self._replace(i, w.exit_reason())
            elif w.silent_for(now) > self.settings.heartbeat_timeout_s:
                silent = w.silent_for(now)
                why = (
                    "failed a request while down" if silent == float("inf") else f"sent no heartbeat for {silent:.1f}s"
                )
                self._replace(i, f"{why} (hung, stopped or down; killed)")

    def stop(self, timeout_s: float) -> None:
        """Stop every lane; each worker process is joined: an idle one exits, one holding groups is killed at once,
        a slow one after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for w in self.current:  # a worker holding groups is mid-call, and what it would still send goes unused
            w.stop(0.0 if w.outstanding else max(0.0, deadline - time.monotonic()))

    def _drain(self, lane) -> None:
        """Handle every message waiting in a lane's pipe (an exited worker's last words included)."""
        try:
            while lane.results.poll():
                self._handle(lane, lane.results.recv())
        except (EOFError, OSError):  # it exited or died; the health check deals with it
            pass

    def _handle(self, lane, msg) -> None:
        if isinstance(msg, RolloutGroup):
            with self._cv:
                task = lane.outstanding.pop(msg.key, None)
                self._cv.notify_all()  # the lane has room again (the dispatcher may send a queued later turn)
                if task is None:
                    return  # not (or no longer) ours: already regenerated elsewhere
            # one entry per call, not per group; a continuous worker's groups of one submit share a start and end
            # apart, each end a span of its own, so the last one shows how long the worker was busy with them
            call = (msg.generate_started_at, msg.generate_s)
            if self._last_call.get(msg.lane_id) != call:
                self._last_call[msg.lane_id] = call
                end = msg.generate_started_at + msg.generate_s
                self.activity.append(("generate", msg.lane_id, msg.generate_started_at, end))
            self._deliver(msg, task)
        elif isinstance(msg, WeightsAdopted):
            self._on_adopted(msg)
        elif isinstance(msg, LaneFailed):
            raise RolloutLaneError(f"{lane.describe()} failed:\n{msg.error}")
        elif isinstance(msg, WorkerReady):
            self.placement[msg.lane_id] = (msg.cores, msg.torch_threads)

    def _replace(self, i: int, why: str) -> None:
        """A lane is lost: what it held goes back to the pool, and it is restarted with the newest weights, or the
        pool fails once ``max_restarts`` is used up."""
        lost = self.current[i]
        lost.kill()
        with self._cv:
            held = list(lost.outstanding.values())
            self._requeue([t for t in held if not t.rows], [t for t in held if t.rows])
            lost.outstanding.clear()
            what = f"{lost.describe()} {why}"
            self.lost_lanes.append(what)
            if not self.backend.restartable:
                self._fail(RolloutLaneError(f"{what}; it cannot be restarted from here"))
                return
            if lost.restarts >= self.settings.max_restarts:
                self._fail(
                    RolloutLaneError(
                        f"{what}; it was already restarted {lost.restarts} time(s) (rollout_max_restarts="
                        f"{self.settings.max_restarts})"
                    )
                )
                return
            self.current[i] = self.backend.start_lane(i, restarts=lost.restarts + 1)
            self.lane_restarts += 1
            self._cv.notify_all()
        logger.warning(
            "%s; %s, %d group(s) it held will be generated again", what, self.backend.restart_note, len(held)
        )

    def _on_adopted(self, msg: WeightsAdopted) -> None:
        with self._cv:
            self.lane_versions[msg.lane_id] = msg.version
        if msg.digest is not None:
            expected = self._expected_digests.get(msg.version)
            if expected != msg.digest:
                raise RolloutLaneError(
                    f"lane {msg.lane_id} holds weights for version {msg.version} that differ from the "
                    "weights the trainer published (digest mismatch)"
                )
            self.verified_adoptions += 1
