"""Tool calls of multi-turn episodes, run beside generation, never on the trainer's step.

What a call returns to the model follows GRPOTrainer 1.16 (``_tool_call_loop``): a result becomes the tool message
``str(result)`` (a list stays a list of content blocks); an unknown tool, a raising tool (bad arguments included) or
a call of another type than ``"function"`` becomes ``str({"error": ...})`` and counts as a failure. Two differences,
both deliberate: results come back in the order of the calls (GRPOTrainer lists sync tools' results before async
ones'), and every call is bounded by ``timeout_s`` (a call that does not return in time is a failure; GRPOTrainer
waits forever).

Sync tools of one turn run one after another, each on a daemon thread that the caller waits for at most
``timeout_s`` (a tool that never returns keeps its thread, which never blocks shutdown); async tools of one turn are
awaited together on one long-lived event loop, each under ``asyncio.wait_for``. ``ToolRunner`` runs the turns of
many episodes at once on a bounded set of threads, so one episode's slow tool never holds up another's.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RECORD_CHARS = 500  # a tool result is cut to this many characters in trajectory records


@dataclass
class ToolResults:
    """The outcome of one turn's tool calls."""

    messages: list[dict]  # {"role": "tool", "name": ..., "content": ...}, in call order
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    records: list[dict] = field(default_factory=list)  # per call: name, arguments, result (cut), failed
    strays: list[threading.Thread] = field(default_factory=list)  # sync calls that timed out and still run


class ToolTimeout(TimeoutError):
    """A sync tool call did not return in time; ``thread`` still runs it."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


def split_tools(tools: Sequence[Callable]) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """``(sync, async)`` tools by ``__name__``, as GRPOTrainer keys them (a later tool of the same name wins)."""
    sync, async_ = {}, {}
    for tool in tools:
        (async_ if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
    return sync, async_


def _call_with_timeout(fn: Callable, arguments: dict, timeout_s: float | None) -> Any:
    if timeout_s is None:
        return fn(**arguments)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"trl_async-tool-{fn.__name__}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ToolTimeout(f"tool {fn.__name__} did not return within {timeout_s:g} s (rollout_tool_timeout_s)", thread)
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _await_all(coroutines: list, timeout_s: float | None) -> list:
    return await asyncio.gather(*(asyncio.wait_for(c, timeout_s) for c in coroutines), return_exceptions=True)


def _call_name(call: dict) -> str:
    return call["function"]["name"] if call.get("type") == "function" else call.get("name", "unknown")


def run_tool_calls(
    calls: Sequence[dict],
    sync_tools: dict[str, Callable],
    async_tools: dict[str, Callable],
    loop: asyncio.AbstractEventLoop | None,
    timeout_s: float | None,
    after_timeout: str | None = None,
    refused: str | None = None,
) -> ToolResults:
    """Run one turn's parsed tool calls (``parse_response``'s ``tool_calls``) and build the tool messages.
    ``after_timeout``: once a sync call times out (it may still be running), the turn's calls not yet run are not run
    (async calls not yet awaited included); each fails with this message (an environment's methods share its state).
    ``refused``: no call runs; each fails with this message."""
    results: list[Any] = [None] * len(calls)
    names: list[str] = []
    failed: list[bool] = [False] * len(calls)
    timeouts = 0
    strays: list[threading.Thread] = []
    pending: list[tuple[int, Any]] = []  # (call index, coroutine)
    for i, call in enumerate(calls):
        names.append(_call_name(call))
        if refused is None and after_timeout is not None and timeouts:
            refused = after_timeout
        if refused is not None:
            results[i], failed[i] = {"error": refused}, True
            continue
        if call.get("type") != "function":
            results[i], failed[i] = {"error": f"Unsupported tool call type: {call.get('type')}"}, True
            continue
        function = call["function"]
        name, arguments = function["name"], function.get("arguments") or {}
        try:
            if name in sync_tools:
                results[i] = _call_with_timeout(sync_tools[name], arguments, timeout_s)
            elif name in async_tools:
                pending.append((i, async_tools[name](**arguments)))
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as exc:  # noqa: BLE001 - reported to the model, as GRPOTrainer does
            timeouts += isinstance(exc, TimeoutError)
            if isinstance(exc, ToolTimeout):
                strays.append(exc.thread)
            results[i], failed[i] = {"error": str(exc)}, True
    if pending and refused is not None:  # coroutines created, never started: nothing of them ran on the state
        for i, coroutine in pending:
            coroutine.close()
            results[i], failed[i] = {"error": refused}, True
        pending = []
    if pending:
        if loop is None:
            raise RuntimeError("an async tool needs the runner's event loop")
        outcomes = asyncio.run_coroutine_threadsafe(_await_all([c for _, c in pending], timeout_s), loop).result()
        for (i, _), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                # asyncio.wait_for's own timeout (a TimeoutError raised by the tool itself is just a failure)
                timed_out = timeout_s is not None and isinstance(outcome, asyncio.TimeoutError | TimeoutError)
                timeouts += timed_out
                message = (
                    f"tool {names[i]} did not return within {timeout_s:g} s (rollout_tool_timeout_s)"
                    if timed_out
                    else str(outcome)
                )
                results[i], failed[i] = {"error": message}, True
            else:
                results[i] = outcome
    messages, records = [], []
    for i, call in enumerate(calls):
        content = results[i] if isinstance(results[i], list) else str(results[i])
        messages.append({"role": "tool", "name": names[i], "content": content})
        arguments = call.get("function", {}).get("arguments") if isinstance(call.get("function"), dict) else None
        records.append(
            {"name": names[i], "arguments": arguments, "result": str(content)[:RECORD_CHARS], "failed": failed[i]}
        )
    return ToolResults(
        messages, calls=len(calls), failures=sum(failed), timeouts=timeouts, records=records, strays=strays
    )


def calls_not_run(calls: Sequence[dict], why: str) -> ToolResults:
    """Failed results for a turn's calls that were not run (``why`` is what the model reads for each)."""
    return run_tool_calls(calls, {}, {}, None, None, refused=why)


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_forever()
    loop.close()


class ToolRunner:
    """Runs episodes' tool turns on ``threads`` daemon threads; ``submit`` returns at once and calls ``done`` with
    the ``ToolResults`` from a runner thread. Async tools share ``loop`` (GRPOTrainer's ``async_loop`` when it has
    one), else the runner's own loop, closed by ``close``."""

    def __init__(self, threads: int, timeout_s: float | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.timeout_s = timeout_s
        self._own_loop = loop is None
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=_run_until_stopped, args=(loop,), name="trl_async-tool-loop", daemon=True).start()
        self.loop = loop
        self._jobs: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"trl_async-tools-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        calls: Sequence[dict],
        tools: tuple[dict, dict],
        done: Callable[[ToolResults], None],
        after_timeout: str | None = None,
    ) -> None:
        self._jobs.put((calls, tools, done, after_timeout))

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            calls, (sync_tools, async_tools), done, after_timeout = job
            try:
                result = run_tool_calls(calls, sync_tools, async_tools, self.loop, self.timeout_s, after_timeout)
            except BaseException as exc:  # noqa: BLE001 - our own fault, not a tool's: the episode reports it
                result = exc
            done(result)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads (one deadline for all: a thread inside a hung call is left to its daemon fate)."""
        import time

        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._own_loop:
            self.loop.call_soon_threadsafe(self.loop.stop)
