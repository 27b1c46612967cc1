"""One vLLM server seen from the pool: a *lane*, what a worker process is for the transformers backend.

The pool's dispatcher hands a lane admitted groups, and the lane issues one ``/inference/v1/generate`` request per
group (``n = num_generations``) from its own threads, many at once, so the server's continuous batching stays full.
Finished groups reach the pool's collector through a pipe exactly like a worker's. A lane health-checks its server
every 0.5 s (``silent_for``: the pool's health check treats a server silent for ``rollout_heartbeat_timeout_s`` as
lost), and a request that fails is retried with backoff for ``rollout_vllm_retry_s`` before the lane reports it.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe

from ...records import LaneFailed, RolloutGroup, RolloutTask, WeightsAdopted
from ..held import HoldsTasks
from .adapters import ServedAdapters
from .client import VLLMServer, VLLMServerError
from .weight_push.recovery import Return

HEALTH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class VLLMLaneSpec:
    lane_id: int
    url: str
    sampling_params: dict  # vLLM SamplingParams fields shared by every request (n, temperature, max_tokens, ...)
    eos_token_ids: tuple[int, ...]
    seed: int
    max_requests: int  # concurrent requests to this server
    request_timeout_s: float
    retry_s: float


def cut_after_eos(token_ids: Sequence[int], eos_token_ids: Sequence[int]) -> int:
    """Length of a completion kept up to and including its first EOS (all of it without one)."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            return i + 1
    return len(token_ids)


@dataclass(eq=False)
class VLLMLane(HoldsTasks):
    spec: VLLMLaneSpec
    capacity: int  # most groups it holds at once
    restarts: int = 0
    outstanding: dict[tuple, RolloutTask] = field(default_factory=dict)  # task key -> task
    adapters: ServedAdapters | None = None  # adapter-only LoRA sync: each request names the newest version
    returning: Return | None = None  # a lane replacing a lost one: no work until its server is re-attached

    @property
    def attached(self) -> bool:
        return self.returning is None or self.returning.attached

    @property
    def max_outstanding(self) -> int:
        """What the dispatcher may hand it: nothing while its server is away or not yet re-attached."""
        return self.capacity if self.attached else 0

    def __post_init__(self) -> None:
        self.server = VLLMServer(self.spec.url, self.spec.request_timeout_s, self.spec.retry_s)
        self.results, self._outbox = Pipe(duplex=False)
        self._outbox_lock = threading.Lock()
        self._tasks: queue.Queue[RolloutTask | None] = queue.Queue()
        self._stopped = threading.Event()
        self._last_healthy = time.time()
        self._gave_up = False  # a request failed with its server down: lost, whatever the server does next
        self._turn_slots = threading.BoundedSemaphore(self.spec.max_requests)  # requests of multi-context tasks
        # daemon threads: a request stuck on a hung server must not keep the interpreter from exiting
        for i in range(self.spec.max_requests):
            threading.Thread(target=self._request_loop, name=f"trl_async-vllm{self.lane_id}-{i}", daemon=True).start()
        threading.Thread(target=self._health_loop, name=f"trl_async-vllm{self.lane_id}-health", daemon=True).start()

    @property
    def lane_id(self) -> int:
        return self.spec.lane_id

    # ---- the pool's view (HoldsTasks) --------------------------------------------------------------------------
    def transmit(self, chunk: list[RolloutTask]) -> None:
        for task in chunk:
            self._tasks.put(task)

    def is_alive(self) -> bool:
        return not self._stopped.is_set()

    def exit_reason(self) -> str:
        return "was stopped"

    def silent_for(self, now: float) -> float:
        if not self.attached:  # waiting for its server: its Return watches the limits
            return 0.0
        if self._gave_up:
            return math.inf
        # a re-attach is the server answering, while its last answered check may be seconds old (a slow check or a
        # slow /server_info before the re-attach)
        heard = self._last_healthy if self.returning is None else max(self._last_healthy, self.returning.attached_at)
        return now - heard

    def describe(self) -> str:
        return f"vLLM server {self.spec.url}"

    def lose(self) -> None:
        """Its server failed a weight sync: an attached lane goes silent at once (the pool replaces it and what it
        held is generated again); a returning one waits to see its server back again before the next attempt."""
        if self.attached:
            self._gave_up = True
        else:
            self.returning.lost_again()

    def adopted(self, version: int) -> None:
        """The server now generates with ``version`` (called after a push)."""
        self._post(WeightsAdopted(self.lane_id, version, None))

    def stop(self, timeout_s: float = 0.0) -> None:
        self.kill()

    def kill(self) -> None:
        self._stopped.set()
        for _ in range(self.spec.max_requests):
            self._tasks.put(None)
        with self._outbox_lock:
            self._outbox.close()
        with contextlib.suppress(Exception):
            self.results.close()

    # ---- lane threads ------------------------------------------------------------------------------------------
    def _post(self, msg) -> None:
        with self._outbox_lock:
            if not self._stopped.is_set():
                with contextlib.suppress(OSError):
                    self._outbox.send(msg)

    def _health_loop(self) -> None:
        while not self._stopped.wait(HEALTH_INTERVAL_S):
            healthy = self.server.healthy(timeout_s=2.0)
            if healthy:
                self._last_healthy = time.time()
            if not self.attached:
                problem = self.returning.watch(healthy, self.server.server_info, time.time())
                if problem is not None:
                    self._post(LaneFailed(self.lane_id, problem))
                    return

    def _request_loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None or self._stopped.is_set():
                return
            try:
                self._post(self._generate(task))
            except Exception as exc:  # noqa: BLE001 - reported to the pool, which raises it on the trainer's thread
                if not self.server.healthy(timeout_s=2.0):
                    # the server is down: the task stays outstanding, the lane goes silent at once (even if the
                    # server answers again meanwhile), and the pool's health check replaces it (what it held is
                    # generated elsewhere; weight_push/recovery.py waits for the server)
                    self._gave_up = True
                    continue
                self._post(LaneFailed(self.lane_id, f"vLLM server {self.spec.url}: {exc}"))

    def _request(self, prompt_ids, params: dict) -> list:
        """One generate request, watched by this lane: abandoned when the lane stops, or when its health thread has
        not seen the server healthy for ``request_timeout_s`` (the request itself may take longer). With adapters,
        it runs on the newest version's adapter, which stays loaded until it ends."""
        adapter = self.adapters.acquire(self.spec.request_timeout_s) if self.adapters is not None else None
        try:
            return self.server.generate(
                prompt_ids,
                params,
                stopped=self._stopped.is_set,
                alive=lambda: self.silent_for(time.time()) < self.spec.request_timeout_s,
                adapter=adapter,
            )
        finally:
            if adapter is not None:
                self.adapters.release(adapter[1])

    def _generate(self, task: RolloutTask) -> RolloutGroup:
        started_at, start = time.time(), time.perf_counter()
        params = {**self.spec.sampling_params, "seed": self.spec.seed + task.group_id}
        if task.contexts:  # later turns, or rollout_generate: one completion per context
            completions = self._generate_contexts(task, params)
        else:
            completions = self._request(task.prompt_ids, params)
            if len(completions) != params["n"]:
                raise VLLMServerError(f"asked for {params['n']} completions, got {len(completions)}")
        elapsed = time.perf_counter() - start
        kept = [cut_after_eos(c.token_ids, self.spec.eos_token_ids) for c in completions]
        return RolloutGroup(
            group_id=task.group_id,
            prompt_index=task.prompt_index,
            prompt_ids=task.prompt_ids,
            completion_ids=tuple(c.token_ids[:n] for c, n in zip(completions, kept, strict=True)),
            logprobs=tuple(c.logprobs[:n] for c, n in zip(completions, kept, strict=True)),
            versions=tuple(c.versions[:n] for c, n in zip(completions, kept, strict=True)),
            lane_id=self.lane_id,
            generate_s=elapsed,
            generate_started_at=started_at,
            rows=task.rows,
        )

    def _generate_contexts(self, task: RolloutTask, params: dict) -> list:
        """One completion per context of ``task``: one request per distinct context (``n`` = its copies), all at
        once (at most ``max_requests`` of them per lane); each request seeded by the group, its first row and the
        context's length, so episodes and their successive turns draw different samples."""
        if task.max_new_tokens:
            params = {**params, "max_tokens": task.max_new_tokens}
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for i, context in enumerate(task.contexts):
            rows_of.setdefault(tuple(context), []).append(i)
        requests = [
            (
                context,
                {
                    **params,
                    "n": len(rows),
                    "seed": params["seed"] + 7919 * (task.rows[rows[0]] + 1) + 104_729 * len(context),
                },
            )
            for context, rows in rows_of.items()
        ]
        answers = self._generate_all(requests)
        completions: list = [None] * len(task.contexts)
        for (context, request), answer in zip(requests, answers, strict=True):
            if len(answer) != request["n"]:
                raise VLLMServerError(f"asked for {request['n']} completions, got {len(answer)}")
            for i, completion in zip(rows_of[context], answer, strict=True):
                completions[i] = completion
        return completions

    def _generate_all(self, requests: list[tuple]) -> list:
        """Each ``(prompt_ids, params)`` request on its own daemon thread (a request stuck on a hung server never
        keeps the interpreter from exiting), at most ``max_requests`` at once per lane."""
        if len(requests) == 1:
            return [self._request(*requests[0])]
        answers: list = [None] * len(requests)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            with self._turn_slots:
                try:
                    answers[i] = self._request(*requests[i])
                except Exception as exc:  # noqa: BLE001 - raised below, on the lane's thread
                    errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i,), name=f"trl_async-vllm{self.lane_id}-turn", daemon=True)
            for i in range(len(requests))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return answers
