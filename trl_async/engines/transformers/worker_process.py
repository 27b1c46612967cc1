"""One rollout worker process as the trainer sees it: start, channels, heartbeat, what it holds, stop.

Each worker gets its own pipes (tasks in, results out) rather than shared queues: a worker killed while writing can
leave a half-written message or a held lock in its channel, and with private channels that damage dies with it.
``outstanding`` is every group sent to the worker and not yet returned, so a lost worker's groups can be generated
again (by someone else, under new group ids) without loss or duplication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ...records import RolloutTask
from ...weights.shared_memory import Digest, SharedMemoryWeights
from ..held import HoldsTasks
from .worker import WorkerSpec, worker_main

STARTUP_GRACE_S = 120.0
_CLOSED = (
    object()
)  # a worker's sender thread: stop  # a starting worker imports torch and builds its model before its first heartbeat


@contextlib.contextmanager
def _no_main_reimport():
    """Spawned and forkserver children re-import the parent's ``__main__`` by default, which re-runs an unguarded user
    script (no ``if __name__ == "__main__"``). Workers need nothing from ``__main__``, so hide it while starting
    them (the forkserver itself starts with the first worker, inside this)."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


@contextlib.contextmanager
def _worker_environment():
    """Environment a worker starts with (the forkserver copies ``os.environ`` when it starts, with the first worker;
    a spawned child when it starts). OpenMP threads that spin while idle take cycles from whatever shares the cores;
    ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep (the user's own setting wins). Read by OpenMP when torch loads, so
    it must be set before the forkserver or child imports torch."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


@dataclass(eq=False)
class WorkerProcess(HoldsTasks):
    spec: WorkerSpec
    process: object
    tasks: object  # Connection: trainer -> worker
    results: object  # Connection: worker -> trainer
    heartbeat: object  # shared double, time.time() of the worker's last beat
    restarts: int = 0
    outstanding: dict[tuple, RolloutTask] = field(default_factory=dict)  # task key -> task, in dispatch order
    max_outstanding: int = 2

    @classmethod
    def start(
        cls,
        ctx,
        spec: WorkerSpec,
        weights: SharedMemoryWeights,
        restarts: int = 0,
        max_outstanding: int = 2,
        base: SharedMemoryWeights | None = None,
    ) -> WorkerProcess:
        task_recv, task_send = ctx.Pipe(duplex=False)
        result_recv, result_send = ctx.Pipe(duplex=False)
        heartbeat = ctx.Value("d", time.time() + STARTUP_GRACE_S, lock=False)
        if restarts:  # a fresh random stream, not a replay of the dead worker's
            spec = dataclasses.replace(spec, seed=spec.seed + 7919 * restarts)
        process = ctx.Process(
            target=worker_main,
            args=(spec, weights, task_recv, result_send, heartbeat, base),
            name=f"trl_async-rollout-{spec.worker_id}",
            daemon=True,
        )
        with _no_main_reimport(), _worker_environment():
            process.start()
        task_recv.close()  # the child holds its own copies; closing ours lets EOF reach the other side
        result_send.close()
        return cls(spec, process, task_send, result_recv, heartbeat, restarts, max_outstanding=max_outstanding)

    @property
    def lane_id(self) -> int:
        return self.spec.worker_id

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self) -> str:
        return f"exited with code {self.process.exitcode}"

    def describe(self) -> str:
        return f"rollout worker {self.lane_id} (pid {self.process.pid})"

    def silent_for(self, now: float) -> float:
        """Seconds since the last heartbeat (negative during the start-up grace)."""
        return now - self.heartbeat.value

    def __post_init__(self) -> None:
        self._sending: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name=f"trl_async-send-{self.process.pid}", daemon=True).start()

    def transmit(self, chunk: list[RolloutTask]) -> None:
        """Hand a registered chunk to this worker's sender thread, which pipes it. A chunk of long contexts can fill
        the pipe until the worker reads it, and a hung worker reads nothing until the health check kills it: the
        pool's one dispatcher must not wait for that, or every other worker would get no work meanwhile."""
        self._sending.put(chunk)

    def _send_loop(self) -> None:
        """Pipe each chunk, in order, then the exit request (``None``); ends when the worker is gone."""
        while (chunk := self._sending.get()) is not _CLOSED:
            try:
                self.tasks.send(chunk)
            except (OSError, TypeError, ValueError):  # the worker was killed: its pipe broke or closed under the send
                return
            if chunk is None:
                return

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit; kill it if it has not after ``timeout_s``. Messages it still sends are discarded
        (so it never blocks on a full pipe). Closes the channels. A worker holding groups, or asked to stop at once, is
        killed without being asked: the dispatcher may be blocked piping it a chunk that fills the pipe, while the
        worker, blocked on its own full result pipe, reads nothing; the exit request would wait behind that chunk."""
        if timeout_s <= 0 or self.outstanding:
            self.kill()
            return
        self._sending.put(None)  # after the chunks already handed over
        deadline = time.monotonic() + timeout_s
        while self.process.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                while self.results.poll():
                    self.results.recv()
            self.process.join(0.05)
        self.kill()

    def kill(self) -> None:
        self._sending.put(_CLOSED)  # (a send blocked on the full pipe ends below, when the pipe breaks)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        for conn in (self.tasks, self.results):
            with contextlib.suppress(Exception):
                conn.close()


def worker_context(model_module: str | None = None):
    """The multiprocessing context workers start in: a forkserver that has imported torch, transformers and the
    worker once, so each worker (and each restart) is a fork of it instead of a fresh interpreter importing them
    again (seconds of CPU per worker). The forkserver starts when the trainer is built
    (``prestart_worker_server``) or with the first worker, so workers see the environment, CPU mask and output streams
    of that moment (``OMP_WAIT_POLICY`` included, see ``_worker_environment``), and it is one per process: a later
    trainer in the same process reuses it. ``__main__`` is not in its preload list and is hidden while it starts
    (``_no_main_reimport``). ``model_module``: the policy class's module, imported too if this call starts the
    forkserver. Off Linux (macOS, where CPython itself avoids forking after such imports; Windows, which has no
    forkserver) workers are spawned."""
    import multiprocessing

    if sys.platform != "linux" or "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    # transformers.modeling_utils: most of a worker's start otherwise (every model class imports it)
    preload = ["torch", "transformers", "transformers.generation", "transformers.modeling_utils", __name__]
    ctx.set_forkserver_preload(preload + ([model_module] if model_module else []))
    return ctx


def prestart_worker_server(model=None) -> None:
    """Start the workers' forkserver now, without waiting for it: its imports (seconds) then overlap
    the trainer's own set-up instead of delaying the first worker, which the first training step waits for. ``model``
    (an instance): its class's module joins the imports. Workers see the environment and CPU mask of this moment
    (``worker_context``). No-op where workers are spawned or the forkserver already runs."""
    from multiprocessing import forkserver

    base = (
        model.get_base_model() if hasattr(model, "get_base_model") else model
    )  # a peft model: the class workers build
    ctx = worker_context(type(base).__module__ if isinstance(base, torch.nn.Module) else None)
    if ctx.get_start_method() != "forkserver":
        return
    with _no_main_reimport(), _worker_environment():
        forkserver.ensure_running()


class ProcessBackend:
    """The pool's backend for ``rollout_backend="transformers"``: worker processes and shared-memory weights.
    ``base_specs``: adapter-only LoRA sync, where ``weight_specs`` are the adapters' tensors (every version) and
    ``base_specs`` the frozen rest, in one shared buffer published once (``publish_base``)."""

    restartable = True
    resync_wanted = False  # a restarted worker reads the shared weights itself: no publish is needed to re-attach it
    restart_note = "restarted it"
    adapter_blocker = None  # workers merge any adapter the trainer can send alone
    needs_base = False  # a restarted worker maps the shared base itself

    def __init__(
        self, specs: list[WorkerSpec], weight_specs: dict, groups_per_call: int, base_specs: dict | None = None
    ) -> None:
        self.specs = specs
        self.ctx = worker_context()
        self.weights = SharedMemoryWeights(weight_specs, self.ctx)
        self.base = SharedMemoryWeights(base_specs, self.ctx, copies=1) if base_specs is not None else None
        self.base_digest: str | None = None
        self.max_outstanding = 2 * groups_per_call  # the chunk being generated and the next one

    def start_lane(self, index: int, restarts: int = 0) -> WorkerProcess:
        return WorkerProcess.start(
            self.ctx, self.specs[index], self.weights, restarts, self.max_outstanding, base=self.base
        )

    @property
    def base_target(self):
        return self.base.spare_tensors if self.base is not None else None

    def publish_base(self, buckets, version: int, digest: Digest | None = None) -> None:
        """The frozen weights of adapter-only LoRA sync, once, before the first version of the adapters (with a
        ``digest``, hashed: every version's digest then chains the base's)."""
        self.base.publish(buckets, version, digest)
        self.base_digest = digest.hexdigest() if digest is not None else None

    @property
    def publish_target(self):
        return self.weights.spare_tensors

    def publish(self, buckets, version: int, digest=None, ready=None) -> None:
        if digest is not None and self.base is not None:  # what a worker generates with: the base and these
            digest.update_text(self.base_digest)
        self.weights.publish(buckets, version, digest, ready)

    def close(self) -> None:
        """After the workers have exited (the pool stops them first): the shared weights are released, so a closed
        pool kept for its counters (``trainer.last_rollout_pool``) holds no copy of the policy."""
        self.weights.release()
        if self.base is not None:
            self.base.release()
