"""``rollout_func``: the user's own rollout, run in the background, once per admitted group.

GRPOTrainer 1.16 calls ``rollout_func(prompts, trainer)`` on its main thread with the per-process slice of the
generation batch (each prompt repeated ``num_generations`` times) and expects ``prompt_ids``, ``completion_ids`` and
``logprobs`` back, one entry per prompt, plus optional ``env_mask`` (1: a model token, 0: a token the rollout added,
masked out of the loss) and extra fields that reach the reward functions. Here the same function runs on a
background thread of the trainer process, for one group at a time (its prompt repeated ``num_generations`` times),
while the trainer trains; several groups' calls run at once, as many as admission control lets in.

What the function may call from there is the contract for asynchronous use:
  * ``trainer.rollout_generate(prompt_ids, max_new_tokens=None)`` samples one completion per token-id list with the
    rollout workers (either backend), with the trainer's generation settings, and returns ``completion_ids``,
    ``logprobs`` (mu: the sampled tokens' log-probs under the distribution sampled from) and ``versions`` (the policy
    version of the weights that sampled each token). Call it as often as the rollout needs (multi-turn: append the
    environment's tokens to the context and call again); other groups' calls share the workers' batches meanwhile.
  * ``trainer.processing_class`` is this thread's own copy of the tokenizer (a fast tokenizer must not be used by
    two threads at once); other attributes are the trainer's, read-only: never call the training model, which the
    main thread is updating.

The version of each returned token, which admission control and ``max_staleness`` need:
  * a returned completion equal to a completion ``rollout_generate`` sampled in this call keeps its tokens' own
    versions;
  * any other completion (edited, or assembled from several calls and environment tokens) takes, for every token,
    the oldest version sampled during this call: a conservative bound, its staleness is never underestimated;
  * a rollout that samples by other means (its own engine) must say with which weights: ``"policy_version"`` in
    its output, an int (every token) or one list of per-token versions per completion. Without either, the group is
    refused with an error, since a stale rollout would otherwise be trained on as if fresh.
``policy_version`` is taken out of the output; everything else but the required keys and ``env_mask`` is
forwarded to the reward functions as GRPOTrainer forwards it. A group the function cannot complete raises
``GroupAbandoned``: it is skipped and counted, and training goes on.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..records import RolloutGroup, RolloutTask

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class GroupAbandoned(Exception):
    """Raised by a ``rollout_func`` for a group it cannot complete (an agent that failed or timed out): the group is
    skipped and counted in ``async/abandoned_groups``, its prompt not retried, and training goes on. Any other
    exception stops training, as in GRPOTrainer."""


class _Closed(BaseException):
    """The runner closed while a rollout was waiting for generation (training ended). A ``BaseException``, so a
    rollout's own ``except Exception`` retry loop does not swallow it."""


@dataclass
class _Call:
    """One ``rollout_func`` call: its group and what it sampled so far (its own threads may sample too: locked)."""

    task: RolloutTask
    next_row: int = 0
    sampled: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)  # completion ids -> versions
    oldest: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rows(self, n: int) -> tuple[int, ...]:
        with self.lock:
            rows = tuple(range(self.next_row, self.next_row + n))
            self.next_row += n
        return rows

    def record(self, completion_ids, versions) -> None:
        """Remember each sampled completion's versions; the same ids sampled twice keep the older version of each
        token, so a returned completion's staleness is never understated."""
        with self.lock:
            for ids, v in zip(completion_ids, versions, strict=True):
                ids, v = tuple(ids), tuple(v)
                seen = self.sampled.get(ids)
                self.sampled[ids] = v if seen is None else tuple(map(min, seen, v))
                if v:
                    self.oldest = min(v) if self.oldest is None else min(self.oldest, min(v))


def _per_row(name: str, values, n: int) -> list:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(
            f"rollout_func returned {got} for {name!r}; it was called with one prompt repeated {n} times "
            f"(num_generations) and must return one entry per prompt, as with GRPOTrainer."
        )
    return list(values)


def build_group(
    task: RolloutTask,
    output: dict,
    call: _Call,
    num_generations: int,
    newest_version: int | None = None,
    lane_id: int = -1,
) -> RolloutGroup:
    """The ``RolloutGroup`` of one ``rollout_func`` output (validated; versions resolved as the module says).
    ``newest_version``: the trainer's version now; a reported version past it cannot be true."""
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func must return a dict, got {type(output).__name__}")
    missing = sorted(set(REQUIRED_KEYS) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    out = dict(output)
    prompt_ids = [tuple(int(t) for t in ids) for ids in _per_row("prompt_ids", out.pop("prompt_ids"), num_generations)]
    completions = [
        tuple(int(t) for t in ids) for ids in _per_row("completion_ids", out.pop("completion_ids"), num_generations)
    ]
    raw_logprobs = out.pop("logprobs")
    if raw_logprobs is None:
        raise ValueError(
            "rollout_func returned logprobs=None: AsyncGRPOTrainer corrects for staleness with the behaviour "
            "log-probs of the sampled tokens; return them (trainer.rollout_generate returns them as 'logprobs')."
        )
    logprobs = []
    for i, (row, ids) in enumerate(zip(_per_row("logprobs", raw_logprobs, num_generations), completions, strict=True)):
        if len(row) != len(ids):
            raise ValueError(f"rollout_func: completion {i} has {len(ids)} tokens but {len(row)} logprobs")
        logprobs.append(tuple(math.nan if lp is None else float(lp) for lp in row))  # None: no mu for that token
    env_mask = out.pop("env_mask", None)
    mask = ()
    if env_mask is not None:
        mask = tuple(tuple(int(m) for m in row) for row in _per_row("env_mask", env_mask, num_generations))
        for i, (row, ids) in enumerate(zip(mask, completions, strict=True)):
            if len(row) != len(ids):
                raise ValueError(f"rollout_func: completion {i} has {len(ids)} tokens but an env_mask of {len(row)}")
    if not any(completions):
        raise ValueError("rollout_func returned only empty completions: a group needs at least one token to train on")
    versions = _versions(out.pop("policy_version", None), completions, call, num_generations)
    newest = max(v for row in versions for v in row)
    if newest_version is not None and newest > newest_version:
        raise ValueError(
            f"rollout_func returned policy_version {newest}, but the trainer is at version {newest_version} "
            "(trainer.state.global_step): report the version of the weights you sampled with"
        )
    return RolloutGroup(
        group_id=task.group_id,
        prompt_index=task.prompt_index,
        prompt_ids=prompt_ids[0],
        completion_ids=tuple(completions),
        logprobs=tuple(logprobs),
        versions=versions,
        lane_id=lane_id,
        generate_s=0.0,
        tool_mask=mask,
        row_prompt_ids=tuple(prompt_ids),
        extra_fields=out,
    )


def _versions(reported, completions: list[tuple[int, ...]], call: _Call, n: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(reported, bool):
        raise ValueError(f"rollout_func returned policy_version={reported!r}; give an int or per-token lists")
    if isinstance(reported, numbers.Integral) or (hasattr(reported, "ndim") and reported.ndim == 0):
        return tuple((int(reported),) * len(ids) for ids in completions)
    if reported is not None:
        rows = _per_row("policy_version", reported, n)
        for i, (row, ids) in enumerate(zip(rows, completions, strict=True)):
            if len(row) != len(ids):
                raise ValueError(f"rollout_func: completion {i} has {len(ids)} tokens but {len(row)} policy versions")
        return tuple(tuple(int(v) for v in row) for row in rows)
    if call.oldest is None:
        raise ValueError(
            "rollout_func sampled nothing with trainer.rollout_generate and returned no 'policy_version': "
            "AsyncGRPOTrainer cannot tell how stale its tokens are. Generate with trainer.rollout_generate, or "
            "return 'policy_version' (the version of the weights you sampled with: an int, or per-token lists)."
        )
    with call.lock:
        return tuple(call.sampled.get(ids, (call.oldest,) * len(ids)) for ids in completions)


class RolloutFuncRunner:
    """Runs ``rollout_func`` for each admitted group on its own thread (the pool's ``starts_groups`` runner, like
    ``EpisodeRunner`` for environments). ``generate`` hands the workers a later-turn task for the calling group and
    waits for it; ``on_turn`` (the pool's collector) delivers it."""

    starts_groups = True

    def __init__(
        self,
        *,
        rollout_func: Callable,
        trainer_view: Callable[[Callable, object], object],
        version: Callable[[], int],
        tokenizer,
        num_generations: int,
        timeout_s: float,
        max_model_len: int | None,
        max_new_tokens: int,
        submit_turn: Callable[[RolloutTask], None],
        finished: Callable[[RolloutGroup], None],
        fail: Callable[[BaseException], None],
        row: Callable[[int], dict],
        abandon=None,
    ) -> None:
        """``row(group_id)``: a group's dataset row, as the pool read it at admission. ``trainer_view(generate,
        tokenizer)``: what ``rollout_func`` receives as its ``trainer``, sampling with ``generate`` and tokenizing with
        this rollout's own ``tokenizer``; ``version()``: the trainer's policy version now."""
        self.rollout_func, self.row, self.num_generations = rollout_func, row, num_generations
        self.timeout_s, self.max_model_len, self.max_new_tokens = timeout_s, max_model_len, max_new_tokens
        self.submit_turn, self.finished, self.fail, self.abandon = submit_turn, finished, fail, abandon
        self.trainer_view, self.version = trainer_view, version
        self._tokenizer = tokenizer  # a private copy: the threads copy it, never the trainer's
        self._tokenizers: queue.SimpleQueue = queue.SimpleQueue()  # copies, each used by one rollout at a time
        self._local = threading.local()
        self._waiting: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: set[threading.Thread] = set()  # one per running rollout, joined at close

    # ---- the pool's side ---------------------------------------------------------------------------------------
    def open(self) -> None:
        """Nothing to start: each rollout gets a thread of its own when its group starts."""

    def start(self, task: RolloutTask) -> None:
        if self._closed.is_set():
            return
        thread = threading.Thread(
            target=self._run, args=(task,), name=f"trl_async-rollout-{task.group_id}", daemon=True
        )
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def on_turn(self, turn: RolloutGroup, admitted_at_version: int) -> None:
        with self._lock:
            future = self._waiting.pop(turn.key, None)
        if future is not None:
            future.set_result(turn)

    def instances(self, group_id: int) -> None:
        return None

    def release(self, group_id: int) -> None:
        pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the rollouts (each sees it at its next ``rollout_generate``), then close the ``rollout_func`` itself
        where it has a ``close`` method (an agent endpoint)."""
        self._closed.set()
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for future in waiting:
            future.set_exception(_Closed())
        # every rollout sees the close at its next rollout_generate; one busy elsewhere (its own engine, a sleep) is
        # waited for up to timeout_s, and whatever it returns is handed to no one
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        close = getattr(self.rollout_func, "close", None)
        if callable(close):
            close()
        running = [t.name for t in threads if t.is_alive()]
        if running:
            logger.warning(
                "closing the rollout_func runner: %d rollout(s) still running after %.0fs (%s); their "
                "output is discarded when they return",
                len(running),
                timeout_s,
                ", ".join(running),
            )

    # ---- the rollout's side ------------------------------------------------------------------------------------
    @property
    def in_rollout(self) -> bool:
        """Whether the calling thread runs a ``rollout_func`` call of this runner."""
        return getattr(self._local, "call", None) is not None

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int | None = None, call: _Call | None = None
    ) -> dict:
        """Sample one completion per context for ``call`` (default: the rollout this thread runs)."""
        call = call or self._local.call
        contexts = tuple(tuple(int(t) for t in ids) for ids in prompt_ids)
        if not contexts or not all(contexts):
            raise ValueError("rollout_generate needs a non-empty list of non-empty token-id lists")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"rollout_generate: max_new_tokens={max_new_tokens}; give a positive number or None")
        budget = max_new_tokens or 0
        longest, new = max(len(c) for c in contexts), budget or self.max_new_tokens
        if self.max_model_len and longest + new > self.max_model_len:
            raise ValueError(
                f"rollout_generate: a context of {longest} tokens (+ up to {new} new) exceeds the "
                f"model's max_position_embeddings={self.max_model_len}; pass a smaller max_new_tokens or "
                "shorten the context"
            )
        rows = call.rows(len(contexts))
        task = call.task
        future: Future = Future()
        turn = RolloutTask(
            task.group_id,
            task.prompt_index,
            contexts[0],
            task.admitted_at_version,
            contexts=contexts,
            rows=rows,
            max_new_tokens=budget,
        )
        with self._lock:
            if self._closed.is_set():
                raise _Closed()
            self._waiting[turn.key] = future
        self.submit_turn(turn)
        try:
            result: RolloutGroup = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._waiting.pop(turn.key, None)
            raise TimeoutError(
                f"rollout_generate waited {self.timeout_s:.0f}s (rollout_timeout_s) for the workers"
            ) from None
        call.record(result.completion_ids, result.versions)
        return {
            "completion_ids": [list(ids) for ids in result.completion_ids],
            "logprobs": [list(lps) for lps in result.logprobs],
            "versions": [list(v) for v in result.versions],
        }

    def _generate_for(self, call: _Call, prompt_ids, max_new_tokens: int | None = None) -> dict:
        return self.generate(prompt_ids, max_new_tokens, call)  # the rollout's own threads sample through it too

    def _run(self, task: RolloutTask) -> None:
        self._local.call = call = _Call(task)
        try:
            tokenizer = self._tokenizers.get_nowait()
        except queue.Empty:
            tokenizer = copy.deepcopy(self._tokenizer)
        try:
            prompt = self.row(task.group_id)["prompt"]
            prompts = [copy.deepcopy(prompt) for _ in range(self.num_generations)]
            generate = functools.partial(self._generate_for, call)
            output = self.rollout_func(prompts, self.trainer_view(generate, tokenizer))
            group = build_group(task, output, call, self.num_generations, self.version())
            if not self._closed.is_set():  # a rollout that outlived training hands nothing to the closed pool
                self.finished(group)
        except _Closed:
            return
        except GroupAbandoned as exc:
            if self._closed.is_set():
                return
            if self.abandon is None:
                self.fail(exc)
            else:
                self.abandon(task, f"rollout_func gave the group up: {exc}", streak=False)
        except BaseException as exc:  # noqa: BLE001 - the user's rollout: training stops with its error, as in TRL
            if not self._closed.is_set():
                exc.add_note(f"(rollout_func, train_dataset row {task.prompt_index})")
                self.fail(exc)
        finally:
            self._local.call = None
            self._tokenizers.put(tokenizer)
            with self._lock:
                self._threads.discard(threading.current_thread())


def replayed_output(rows: Sequence[tuple[RolloutGroup, int]]) -> dict:
    """The output a ``rollout_func`` gave for these rows (completion ``j`` of each group), in GRPOTrainer's format:
    what its ``_generate`` gets when the trainer consumes them. Extra fields are left out: the rewards were computed
    in the background, each group with its own (``with_extra_fields``), and GRPOTrainer uses them for nothing else."""
    out: dict = {
        "prompt_ids": [list(g.row_prompt_ids[j]) for g, j in rows],
        "completion_ids": [list(g.completion_ids[j]) for g, j in rows],
        "logprobs": [list(g.logprobs[j]) for g, j in rows],
    }
    if any(g.tool_mask for g, _ in rows):
        out["env_mask"] = [list(g.tool_mask[j]) if g.tool_mask else [1] * len(g.completion_ids[j]) for g, j in rows]
    return out
