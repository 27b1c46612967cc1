"""What a ``RolloutPool`` shows of itself: where weights are written, its lanes and their counters, and how many
groups are where. Read by the trainer's metrics, the benchmarks and diagnostics; each read takes the pool's lock
where the value moves."""

from __future__ import annotations

import torch

from ..records import RolloutTask


class PoolReadouts:
    """Mixed into ``RolloutPool``: reads its ``backend``, ``lanes``, ``_ledger``, ``_ready``, ``_episodes``,
    ``settings``, ``filtered_groups`` and ``_cv``."""

    @property
    def publish_target(self) -> dict[str, torch.Tensor]:
        """Where the next ``publish`` writes in place (``SharedMemoryWeights.spare_tensors``), or ``None``."""
        return self.backend.publish_target

    @property
    def base_target(self) -> dict[str, torch.Tensor]:
        """Where ``publish_base`` writes in place (adapter-only LoRA sync), or ``None``."""
        return self.backend.base_target

    @property
    def current_lanes(self) -> list:
        """The lanes now, by index (a restarted lane replaces the lost one)."""
        return list(self.lanes.current)

    def outstanding(self, lane_id: int) -> list[RolloutTask]:
        """Groups handed to a lane and not yet returned (for diagnostics)."""
        with self._cv:
            return list(self.lanes.current[lane_id].outstanding.values())

    # what the lanes observed (lanes.py)
    lane_versions = property(lambda self: self.lanes.lane_versions)
    lane_restarts = property(lambda self: self.lanes.lane_restarts)
    lost_lanes = property(lambda self: self.lanes.lost_lanes)
    verified_adoptions = property(lambda self: self.lanes.verified_adoptions)
    published_version = property(
        lambda self: self._ledger.published
    )  # the newest version workers can see (None: none)
    placement = property(lambda self: self.lanes.placement)  # worker id -> (cores, torch threads), as reported

    @property
    def runner(self):
        """The episode or ``rollout_func`` runner that starts and continues groups (``None``: single-turn)."""
        return self._episodes

    @property
    def admitted(self) -> int:
        """Groups dispatched to workers so far, not counting dropped ones."""
        with self._cv:
            return self._ledger.admitted

    @property
    def in_flight(self) -> int:
        """Groups admitted and not yet consumed: queued, being generated or scored, or ready (bounded by
        ``queue_size``)."""
        with self._cv:
            return self._ledger.in_flight

    @property
    def ready_count(self) -> int:
        """Scored groups waiting for the trainer."""
        with self._cv:
            return len(self._ready)

    def _take_timeout(self, missing: int, consumer_version: int) -> TimeoutError:
        """What ``take`` raises when ``missing`` groups did not come in time: where every group is (caller holds the
        lock)."""
        return TimeoutError(
            f"waited {self.settings.timeout_s:.0f}s (rollout_timeout_s) for {missing} more rollout "
            f"groups at trainer version {consumer_version}; published version {self._ledger.published}, "
            f"admitted {self._ledger.admitted}, consumed {self._ledger.consumed}, filtered "
            f"{self.filtered_groups} (dynamic_sampling); the lanes (workers or servers): versions "
            f"{self.lane_versions}, alive {[w.is_alive() for w in self.lanes.current]}, taking work "
            f"{[w.max_outstanding > 0 for w in self.lanes.current]}; ready {len(self._ready)} "
            f"(rollout_consumption_window={self.settings.consumption_window}); {self._scoring_state()}"
        )
