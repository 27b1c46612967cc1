"""Records that cross a stage boundary (trainer <-> rollout workers).

This leaf module imports nothing from the rest of the package, so a worker process can import it without pulling in
the trainer. Everything here is plain data: lists of ints/floats, picklable through a multiprocessing queue.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RolloutTask:
    """One group to generate: ``num_generations`` completions of one prompt.

    ``admitted_at_version`` is the newest published policy version when admission control let the task in; the
    worker generates with that version or a newer one.
    """

    group_id: int
    prompt_index: int  # row of ``train_dataset``
    prompt_ids: tuple[int, ...]
    admitted_at_version: int


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """All completions of one prompt, as a worker produced them.

    ``versions[i][t]`` is the policy version whose forward pass gave the logits token ``t`` of completion ``i`` was
    sampled from, and ``logprobs[i][t]`` is that token's log-probability under the distribution actually sampled from
    (temperature, top-k, top-p, min-p and repetition penalty applied), i.e. the behaviour policy mu.
    """

    group_id: int
    prompt_index: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    versions: tuple[tuple[int, ...], ...]
    worker_id: int
    generate_s: float  # wall time of the generate call that produced this group (shared by its batch)
    generate_started_at: float = 0.0  # time.time() when that call started (comparable across processes)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @property
    def token_versions(self) -> list[int]:
        """Every token's version, flattened (the staleness functions take this)."""
        return [v for completion in self.versions for v in completion]


@dataclass(frozen=True, slots=True)
class WeightsAdopted:
    """A worker reports that it now generates with ``version`` (``digest`` set when weight verification is on)."""

    worker_id: int
    version: int
    digest: str | None


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A worker caught an exception; it exits after sending this."""

    worker_id: int
    error: str  # formatted traceback


@dataclass(frozen=True, slots=True)
class WorkerReady:
    worker_id: int
    pid: int
