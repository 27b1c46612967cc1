"""Multi-turn episodes with tool calls: a turn is a unit of generation, an episode a unit of scheduling.

GRPOTrainer 1.16 calls tools in lock-step over its batch (``_tool_call_loop``): every rollout's turn is generated,
then every tool call runs, then the next turns are generated together, so the batch waits for its slowest tool and
its longest episode. Here each episode advances on its own: when a rollout worker returns a turn, the
``EpisodeRunner`` parses it (TRL's ``parse_response``, with the tools the prompt was rendered with), hands its tool
calls to the ``ToolRunner`` and, when they return, asks for the next turn, while the workers generate other
episodes. A group goes on to scoring when all ``num_generations`` of its episodes have ended.

The tokens are the ones GRPOTrainer builds: the completion is turn 1 + tool suffix + turn 2 + ... where the suffix is
GRPOTrainer's own ``_get_tool_suffix_ids`` rendering of the tool messages (tool turn and the next generation prompt);
suffix tokens get ``tool_mask`` 0 and a 0.0 log-prob placeholder; ``max_completion_length`` bounds the whole
completion (a later turn gets what is left; tool results that would overflow it, or reach the model's
``max_position_embeddings``, are rolled back and the episode ends on the turn that called them);
``max_tool_calling_iterations`` bounds the rounds of tool calls. Every sampled token keeps the version of the weights
that produced it, so one episode may span several versions; a suffix token carries the version of the sampled token
before it, so an episode's staleness is that of its oldest sampled token.

With ``environment_factory`` each episode gets its own environment instance from an ``EnvironmentPool`` (built by the
factories, reused across episodes as GRPOTrainer reuses them): ``reset(**row)`` starts the episode and its return
value is appended to the last prompt message, the instance's public methods are the episode's tools, and the
instance stays with the group until its rewards are computed (environment-owned rewards read its state), then goes
back to the pool. A ``reset`` that raises abandons the group (counted, logged); training goes on. Once a call of an
environment episode times out (``rollout_tool_timeout_s``) it may still be running on the instance: the episode's
later calls are not run (each a failed call that says why), and the group is scored only once that call has
returned, so its rewards never read an instance that a call is still changing. The wait runs on a thread of its own
(never the trainer's or this runner's), for at most another ``rollout_tool_timeout_s``; a call still running then
leaves the instance's state unknowable, and the group is abandoned (counted in ``async/abandoned_groups``, its prompt
not retried). Either way the instance is dropped instead of going back to the pool.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace

from trl.chat_template_utils import parse_response

from ..records import RolloutGroup, RolloutTask
from .environments import EnvironmentPool, environment_tools, with_observation
from .episode_state import Episode, EpisodeGroup
from .grpo_private import ToolSuffix
from .tool_calls import ToolResults, ToolRunner, calls_not_run, split_tools

ENVIRONMENT_BUSY = (
    "not run: an earlier call of this episode timed out (rollout_tool_timeout_s) and may still be running "
    "on its environment"
)

logger = logging.getLogger(__name__)


class EpisodeRunner:
    """Advances the episodes of every admitted group on one thread (it owns its tokenizer copy). Turns arrive with
    ``on_turn`` (the pool's collector thread), tool results from the ``ToolRunner``'s threads; the runner asks for
    later turns with ``submit_turn``, hands finished groups to ``finished`` and reports its own errors to ``fail``."""

    def __init__(
        self,
        *,
        tokenizer,
        chat_template: str | None,
        chat_template_kwargs: dict,
        tools: list,
        max_rounds: int,
        max_completion_length: int,
        max_model_len: int | None,
        tool_runner: ToolRunner,
        tool_dicts: tuple[dict, dict],
        submit_turn: Callable[[RolloutTask], None],
        finished: Callable[[RolloutGroup], None],
        fail: Callable[[BaseException], None],
        environments: EnvironmentPool | None = None,
        standalone_tools: Sequence = (),
        schema_tools: dict | None = None,
        multi_environment: bool = False,
        row: Callable[[int], dict] | None = None,
        num_generations: int = 1,
        abandon: Callable[[RolloutTask, str], None] | None = None,
    ) -> None:
        """With ``environments``: the dataset rows (``row(group_id)``: as the pool read it at admission) start
        episodes (``reset``), ``schema_tools`` maps an environment
        name to the tools its prompts render (GRPOTrainer's ``_env_tools``), ``abandon`` takes back a group whose
        ``reset`` raised."""
        self.tokenizer = tokenizer
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs)
        self.environments, self.standalone_tools = environments, list(standalone_tools)
        self.schema_tools, self.multi_environment = schema_tools or {}, multi_environment
        self.row, self.num_generations, self.abandon = row, num_generations, abandon
        self._held: dict[int, EpisodeGroup] = {}  # environments: groups handed to scoring, until release()
        self.tools = tools
        self.max_rounds = max_rounds
        self.max_completion_length = max_completion_length
        self.max_model_len = max_model_len
        self.tool_runner = tool_runner
        self.tool_dicts = tool_dicts
        self.submit_turn, self.finished, self.fail = submit_turn, finished, fail
        self._suffix = ToolSuffix(tokenizer, chat_template, chat_template_kwargs)  # GRPOTrainer's, on our copy
        self._can_parse = (
            getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None
        )
        self._groups: dict[int, EpisodeGroup] = {}
        self._events: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trl_async-episodes", daemon=True)

    def open(self) -> None:
        self._thread.start()

    def on_turn(self, turn: RolloutGroup, admitted_at_version: int) -> None:
        self._events.put(("turn", turn, admitted_at_version))

    @property
    def starts_groups(self) -> bool:
        """With environments the runner starts each admitted group itself (``reset``, then the first turn)."""
        return self.environments is not None

    def start(self, task: RolloutTask) -> None:
        self._events.put(("start", task))

    def instances(self, group_id: int) -> list | None:
        """The environment instances of a finished group (its rewards may read them), until ``release``."""
        group = self._held.get(group_id)
        return group.instances if group is not None else None

    def release(self, group_id: int) -> None:
        group = self._held.pop(group_id, None)
        if group is not None:
            self._release(group)

    def _release(self, group: EpisodeGroup) -> None:
        """Back to the pool, except an instance a timed-out call may still be using (it is dropped: the pool makes a
        new one when needed)."""
        self.environments.release(
            group.environment,
            [
                instance
                for instance, episode in zip(group.instances, group.episodes, strict=False)
                if not episode.timed_out
            ],
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the runner: its thread is joined, then every environment instance goes back to the pool. An event
        still running after ``timeout_s`` (a slow ``reset`` or tool call) is not waited for: the thread releases the
        instances itself when that call returns, and starts nothing after it."""
        self._closed.set()
        self._events.put(None)
        if self._thread.ident is None:  # never opened
            self._release_all()
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "closing the episode runner: a reset or tool call still runs after %.0fs; its environments "
                "are released when it returns",
                timeout_s,
            )
        else:
            self._release_all()  # the thread has stopped (it released them itself if it saw the close)

    def _release_all(self) -> None:
        """Every held instance back to the pool (the runner's thread, or after it stopped)."""
        groups = list(self._groups.values())
        self._groups.clear()
        for group_id in list(self._held):  # one by one: a late scoring thread may release one meanwhile (release())
            group = self._held.pop(group_id, None)
            if group is not None:
                groups.append(group)
        for group in groups:
            if group.instances:
                self._release(group)

    def _serve(self) -> None:
        try:
            while True:
                event = self._events.get()
                if event is None or self._closed.is_set():
                    return
                try:
                    if event[0] == "turn":
                        self._on_turn(event[1], event[2])
                    elif event[0] == "start":
                        self._on_start(event[1])
                    elif event[0] == "settled":
                        self._on_settled(*event[1:])
                    else:
                        self._on_tools(*event[1:])
                except BaseException as exc:  # noqa: BLE001 - the pool fails and the trainer raises it
                    self.fail(exc)
                    return
        finally:
            if self._closed.is_set():
                self._release_all()

    def _on_start(self, task: RolloutTask) -> None:
        """Environments: one instance per episode, ``reset`` with the dataset row, the prompt with its observation."""
        row = self.row(task.group_id)
        name = row.get("environment") if self.multi_environment else None
        if name not in self.environments.factories:
            raise ValueError(
                f"train_dataset row {task.prompt_index} has environment={name!r}, which is not among the "
                f"environments passed to environment_factory: {list(self.environments.factories)}"
            )
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row
        prompt = row.get("prompt", [{"role": "user", "content": ""}])
        group = EpisodeGroup(None, task.admitted_at_version, [], environment=name)
        self._groups[task.group_id] = group  # from its first instance on: released with the others at close
        for _ in range(self.num_generations):
            if self._closed.is_set():  # closed during a slow reset: no more resets, and no turn asked for
                return
            instance = self.environments.acquire(name)  # a factory that raises stops training (like a bad config)
            group.instances.append(instance)
            try:
                observation = instance.reset(**copy.deepcopy(kwargs))  # each its own: a reset may change them
            except Exception:  # noqa: BLE001 - a user's environment: reported, the group is skipped
                del self._groups[task.group_id]
                self.environments.release(name, group.instances)
                self.abandon(task, f"the environment's reset raised:\n{traceback.format_exc()}")
                return
            episode = Episode(self._tokenize(with_observation(prompt, observation), name))
            episode.prompt = with_observation(prompt, observation)
            episode.tool_dicts = split_tools(self.standalone_tools + environment_tools(instance))
            episode.schema_tools = self.schema_tools.get(name)
            group.episodes.append(episode)
        if self._closed.is_set():
            return
        self.submit_turn(
            replace(
                task,
                prompt_ids=tuple(group.episodes[0].prompt_ids),
                contexts=tuple(tuple(e.prompt_ids) for e in group.episodes),
                rows=tuple(range(len(group.episodes))),
            )
        )

    def _tokenize(self, prompt: list[dict], name) -> list[int]:
        """As GRPOTrainer renders a prompt of this environment (its tool schema in the system prompt)."""
        out = self.tokenizer.apply_chat_template(
            conversation=[prompt],
            tools=self.schema_tools.get(name) or None,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.chat_template_kwargs,
        )
        return list(out["input_ids"][0])

    def _on_turn(self, turn: RolloutGroup, admitted_at_version: int) -> None:
        if not turn.rows:  # a first turn: the group's episodes start
            group = EpisodeGroup(
                turn, admitted_at_version, [Episode(list(turn.prompt_ids)) for _ in turn.completion_ids]
            )
            self._groups[turn.group_id] = group
            rows = range(len(turn.completion_ids))
        else:
            group, rows = self._groups[turn.group_id], turn.rows
            group.first = group.first or turn
        for row, ids, logprobs, versions in zip(rows, turn.completion_ids, turn.logprobs, turn.versions, strict=True):
            episode = group.episodes[row]
            first = not episode.turns
            tools = self.tools if episode.schema_tools is None else episode.schema_tools
            parsed = self._parse(list(ids), episode, tools) if (ids or first) else {}
            episode.add_turn(ids, logprobs, versions, parsed, turn.lane_id)
            calls = episode.pending_calls(parsed, self.max_rounds)
            if calls and episode.timed_out and group.instances:
                # an earlier call of this episode timed out and may still be running on the episode's environment:
                # nothing more runs on it (calls would overlap it); the model reads why, as for any failed call
                self._events.put(("tools", turn.group_id, row, calls_not_run(calls, ENVIRONMENT_BUSY)))
            elif calls:
                self.tool_runner.submit(
                    calls,
                    episode.tool_dicts or self.tool_dicts,
                    lambda result, g=turn.group_id, r=row: self._events.put(("tools", g, r, result)),
                    after_timeout=ENVIRONMENT_BUSY if group.instances else None,
                )
            else:
                self._end(turn.group_id, episode)

    def _parse(self, ids: list[int], episode: Episode, tools) -> dict:
        """As GRPOTrainer's ``_generate``: ``parse_response`` for a conversational prompt when the tokenizer has a
        response parser (tool calls come only from it), else the decoded text; ``{}`` for a plain-text prompt
        (reward functions then get the decoded completion, as without tools)."""
        if episode.prompt is not None and not isinstance(episode.prompt, list):
            return {}
        if self._can_parse:
            return parse_response(self.tokenizer, ids, prefix=episode.context, tools=tools)
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}

    def _on_tools(self, group_id: int, row: int, result: ToolResults | BaseException) -> None:
        if isinstance(result, BaseException):
            raise result
        group = self._groups[group_id]
        episode = group.episodes[row]
        suffix = self._suffix.ids(result.messages)
        if not episode.add_tool_results(result, suffix, self.max_completion_length, self.max_model_len):
            self._end(group_id, episode)
            return
        left = self.max_completion_length - len(episode.completion_ids)
        if left <= 0:  # the suffix filled the budget exactly: nothing more can be sampled
            self._end(group_id, episode)
            return
        first = group.first
        self.submit_turn(
            RolloutTask(
                group_id,
                first.prompt_index,
                first.prompt_ids,
                group.admitted_at_version,
                contexts=(tuple(episode.context),),
                rows=(row,),
                max_new_tokens=left,
            )
        )

    def _end(self, group_id: int, episode: Episode) -> None:
        episode.done = True
        group = self._groups[group_id]
        if not all(e.done for e in group.episodes):
            return
        strays = [t for e in group.episodes for t in e.strays if t.is_alive()] if group.instances else []
        if strays:  # a timed-out call still runs on an instance its rewards would read: scored once it returns
            threading.Thread(
                target=self._settle, args=(group_id, strays), name="trl_async-settle", daemon=True
            ).start()
            return
        self._finish(group_id, group)

    def _finish(self, group_id: int, group: EpisodeGroup) -> None:
        del self._groups[group_id]
        if group.instances:
            self._held[group_id] = group  # until its rewards are computed (release)
        self.finished(group.record())

    def _settle(self, group_id: int, strays: list[threading.Thread]) -> None:
        """Wait (on its own thread) for the timed-out calls of a finished group, at most another timeout."""
        deadline = time.monotonic() + (self.tool_runner.timeout_s or 0.0)
        for thread in strays:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._events.put(("settled", group_id, not any(t.is_alive() for t in strays)))

    def _on_settled(self, group_id: int, returned: bool) -> None:
        group = self._groups[group_id]
        if returned:
            self._finish(group_id, group)
            return
        del self._groups[group_id]
        self._release(group)  # (the instances the stray calls hold are dropped)
        first = group.first
        self.abandon(
            RolloutTask(group_id, first.prompt_index, first.prompt_ids, group.admitted_at_version),
            f"a tool call that timed out (rollout_tool_timeout_s={self.tool_runner.timeout_s:g}) was still "
            "running on its environment another timeout later, so no reward could read a settled state",
        )
