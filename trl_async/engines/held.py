"""What the rollout pool sees of a lane (a worker process or a vLLM server): the groups it holds."""

from __future__ import annotations

from ..records import RolloutTask


class HoldsTasks:
    """``outstanding`` (task key -> task, in dispatch order; a dataclass field of the lane) is every group handed to the
    lane and not yet returned, so a lost lane's groups can be generated again. The pool registers a chunk under its
    lock and transmits it outside (a chunk of long contexts can fill a worker's pipe until the worker reads it)."""

    outstanding: dict[tuple, RolloutTask]

    def send(self, chunk: list[RolloutTask]) -> None:
        self.register(chunk)
        self.transmit(chunk)

    def register(self, chunk: list[RolloutTask]) -> None:
        for task in chunk:
            self.outstanding[task.key] = task

    def transmit(self, chunk: list[RolloutTask]) -> None:
        raise NotImplementedError
