"""The state of multi-turn episodes as ``EpisodeRunner`` (episodes.py) builds them: one episode's tokens, log-probs,
versions, tool mask and messages, turn by turn, with the roll-back rule for tool results that would overflow; and a
group's episodes, recorded as the ``RolloutGroup`` that goes on to scoring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..records import RolloutGroup
from .tool_calls import ToolResults


@dataclass
class Episode:
    """One rollout of a group, turn by turn."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the parsed completion, as reward functions receive it
    prompt: list | None = None  # the prompt messages (environments: with the reset observation)
    tool_dicts: tuple[dict, dict] | None = None  # (sync, async) tools by name; None: the runner's
    schema_tools: list | None = None  # tools the prompt was rendered with (parse_response casts arguments by them)
    tool_calls: int = 0
    tool_failures: int = 0
    rounds: int = 0  # rounds of tool calls executed
    turns: list[dict] = field(default_factory=list)
    done: bool = False
    timed_out: bool = False  # a call timed out: it may still be running (on this episode's environment)
    strays: list = field(default_factory=list)  # the threads of its sync calls that timed out

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_turn(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], parsed: dict, lane_id: int
    ) -> None:
        """Append a sampled turn (already within the budget) and its parsed message (``{}``: nothing to add)."""
        self.completion_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.tool_mask += [1] * len(ids)
        if parsed:
            self.messages.append(parsed)
        self.turns.append({"versions": sorted(set(versions)), "tokens": len(ids), "worker_id": lane_id})

    def pending_calls(self, parsed: dict, max_rounds: int) -> list[dict]:
        """The tool calls the last turn asks for, if another round is allowed."""
        calls = parsed.get("tool_calls") if parsed else None
        return list(calls) if calls and self.rounds < max_rounds else []

    def add_tool_results(
        self, results: ToolResults, suffix_ids: Sequence[int], max_completion_length: int, max_model_len: int | None
    ) -> bool:
        """Append the tool messages and their suffix tokens; ``False`` (rolled back, nothing appended) when they
        would overflow ``max_completion_length`` or reach ``max_model_len``, as GRPOTrainer does."""
        self.timed_out = self.timed_out or results.timeouts > 0
        self.strays += results.strays
        self.tool_calls += results.calls
        self.tool_failures += results.failures
        self.rounds += 1
        self.turns[-1]["tool_calls"] = results.records
        length = len(self.prompt_ids) + len(self.completion_ids) + len(suffix_ids)
        if length - len(self.prompt_ids) > max_completion_length or (max_model_len and length >= max_model_len):
            self.turns[-1]["rolled_back"] = True
            return False
        self.messages += results.messages
        self.completion_ids += suffix_ids
        self.logprobs += [0.0] * len(suffix_ids)
        self.versions += [self.versions[-1]] * len(suffix_ids)
        self.tool_mask += [0] * len(suffix_ids)
        return True


@dataclass
class EpisodeGroup:
    """A group's episodes, until every one has ended; ``record`` is what goes on to scoring."""

    first: RolloutGroup | None  # the first turn, as a worker returned it
    admitted_at_version: int
    episodes: list[Episode]
    environment: object = None  # environments: the name of the group's environment
    instances: list = field(default_factory=list)  # environments: one instance per episode

    def record(self) -> RolloutGroup:
        eps = self.episodes
        rows = {}
        if self.instances:
            rows = dict(
                row_prompts=tuple(e.prompt for e in eps), row_prompt_ids=tuple(tuple(e.prompt_ids) for e in eps)
            )
        return replace(
            self.first,
            rows=(),
            **rows,
            completion_ids=tuple(tuple(e.completion_ids) for e in eps),
            logprobs=tuple(tuple(e.logprobs) for e in eps),
            versions=tuple(tuple(e.versions) for e in eps),
            tool_mask=tuple(tuple(e.tool_mask) for e in eps),
            completions=tuple(list(e.messages) for e in eps) if any(e.messages for e in eps) else (),
            tool_calls=tuple(e.tool_calls for e in eps),
            tool_failures=tuple(e.tool_failures for e in eps),
            turns=tuple(tuple(e.turns) for e in eps),
        )
