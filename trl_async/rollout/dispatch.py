"""Where the dispatcher sends the next chunk, and what goes in it: pure functions over the lanes' outstanding work.

Loads are counted in groups: a later turn of a multi-turn episode continues a few rows of a group, and counts as
``rows / num_generations`` of one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from ..records import RolloutTask


def load(outstanding: Mapping, rows_per_group: int) -> float:
    """Groups' worth of work a lane holds (``outstanding``: its tasks handed and not yet returned)."""
    return sum(len(t.contexts) / rows_per_group if t.contexts else 1 for t in outstanding.values())


def pick_lane(lanes: Sequence, per_call: int, rows_per_group: int, last_chunk: Mapping[int, int]):
    """The lane that takes the next chunk of up to ``per_call`` groups: of the lanes with room for it (under their
    ``max_outstanding``), the least loaded; of equal loads, the one handed a chunk longest ago (``last_chunk``:
    ``id(lane)`` -> the number of the last chunk it got; never handed one comes first). ``None``: no lane has room."""
    room = [w for w in lanes if load(w.outstanding, rows_per_group) + per_call <= w.max_outstanding]
    if not room:
        return None
    return min(room, key=lambda w: (load(w.outstanding, rows_per_group), last_chunk.get(id(w), -1)))


def later_turn_chunk(later_turns: deque[RolloutTask], max_rows: int) -> list[RolloutTask]:
    """Take the next later turns, oldest first, up to ``max_rows`` rows (always at least one turn)."""
    chunk = [later_turns.popleft()]
    rows = len(chunk[0].contexts)
    while later_turns and rows + len(later_turns[0].contexts) <= max_rows:
        rows += len(later_turns[0].contexts)
        chunk.append(later_turns.popleft())
    return chunk
