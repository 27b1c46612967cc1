"""Records that cross a stage boundary (trainer <-> rollout workers).

This leaf module imports nothing from the rest of the package, so a worker process can import it without pulling in
the trainer. Everything here is plain data: lists of ints/floats, picklable through a multiprocessing queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# processor fields with one entry per prompt token (nonzero on image tokens): Gemma 3's token_type_ids, Qwen-VL's
# mm_token_type_ids; a RolloutTask carries them beside its image inputs, and a worker left-pads them as the prompt ids
PER_TOKEN_FIELDS = frozenset({"token_type_ids", "mm_token_type_ids"})


@dataclass(frozen=True, slots=True)
class RolloutTask:
    """One group to generate: ``num_generations`` completions of one prompt.

    ``admitted_at_version`` is the newest published policy version when admission control let the task in; the
    worker generates with that version or a newer one.
    """

    group_id: int
    prompt_index: int  # row of ``train_dataset`` (an iterable dataset's: the row's draw number)
    prompt_ids: tuple[int, ...]
    admitted_at_version: int
    # a later turn of multi-turn episodes (tools): one full context per row (prompt + the episode's completion so
    # far), for episodes ``rows`` of the group, at most ``max_new_tokens`` new tokens each (what is left of
    # max_completion_length). Empty: the first turn, ``num_generations`` rows of ``prompt_ids``.
    contexts: tuple[tuple[int, ...], ...] = ()
    rows: tuple[int, ...] = ()
    max_new_tokens: int = 0  # 0: the generation config's
    # a vision-language prompt: the processor's other outputs for it (``pixel_values``, ``image_sizes``, ...), one
    # entry per image along the first dimension, or one per prompt token (``token_type_ids``; numpy arrays); empty
    # for text prompts
    images: dict = field(default_factory=dict, compare=False)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        """Identifies the task among those outstanding (a group may have several later turns in flight)."""
        return self.group_id, self.rows


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
    lane_id: int  # the lane that generated it: a worker process's or a vLLM server's index
    generate_s: float  # wall time from the call's start to this group (a static batch's groups share it)
    generate_started_at: float = 0.0  # time.time() when that call started (comparable across processes)
    rows: tuple[int, ...] = ()  # a later turn: the episodes these completions continue (RolloutTask.rows)
    # multi-turn episodes, assembled by the trainer process (rollout/episodes.py); empty for single-turn groups.
    # ``tool_mask[i][t]`` is 1 for a sampled token, 0 for a tool-result token (no mu: its logprob is a 0.0
    # placeholder and its version that of the model token before it); ``completions`` are the parsed messages
    # reward functions receive; ``turns`` the per-turn record (version, tool calls, results) for trajectories.
    tool_mask: tuple[tuple[int, ...], ...] = ()
    # with environments each episode's prompt carries its own ``reset`` observation: its messages and token ids
    row_prompts: tuple = ()
    row_prompt_ids: tuple[tuple[int, ...], ...] = ()
    completions: tuple = ()
    tool_calls: tuple[int, ...] = ()  # per episode
    tool_failures: tuple[int, ...] = ()
    turns: tuple = ()
    # rollout_func: the fields of its output that reach the reward functions (a list: one value per completion)
    extra_fields: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return self.group_id, self.rows

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Completion tokens the model sampled (tool-result tokens excluded)."""
        return sum(sum(m) for m in self.tool_mask) if self.tool_mask else self.num_tokens

    @property
    def token_versions(self) -> list[int]:
        """Every token's version, flattened (the staleness functions take this)."""
        return [v for completion in self.versions for v in completion]


@dataclass(frozen=True, slots=True)
class WeightsAdopted:
    """A lane reports that it now generates with ``version`` (``digest`` set when weight verification is on)."""

    lane_id: int
    version: int
    digest: str | None


@dataclass(frozen=True, slots=True)
class LaneFailed:
    """A lane caught an exception (a worker process exits after sending this)."""

    lane_id: int
    error: str  # formatted traceback


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker process has started: where it runs."""

    lane_id: int
    pid: int
    cores: tuple[int, ...] = ()  # where it runs (os.sched_getaffinity), as it reports it
    torch_threads: int = 0
