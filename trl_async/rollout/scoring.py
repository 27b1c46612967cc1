"""Reward scoring of finished groups, run in the trainer process on a background thread, and what a reward function
receives: ``reward_rows`` (the dataset rows, per completion) and ``decode_completions`` (the completions), put
together by ``group_scorer`` for the pool's scoring threads.

It mirrors the *local* half of ``GRPOTrainer._calculate_rewards`` (custom functions, async functions, reward models,
``None`` -> NaN, one value per completion) without its ``gather``: a collective must never run off the main thread.
The trainer gathers the pre-computed rows on the main thread when it consumes the groups, and GRPOTrainer's own code
turns them into advantages.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn
from trl.chat_template_utils import parse_response
from trl.data_utils import apply_chat_template, is_conversational
from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

from ..records import RolloutGroup
from .images import prompt_with_images, row_images
from .scored import ScoredGroup

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it and shows the input."""


def decode_completions(tokenizer, prompt_ids: Sequence[Sequence[int]], completion_ids, conversational: bool) -> list:
    """Decode completions exactly as ``GRPOTrainer._generate`` does (no tools; a processor's own tokenizer parses)."""
    if conversational:
        text = getattr(tokenizer, "tokenizer", tokenizer)
        if Version(transformers.__version__) >= Version("5.0.0") and (
            getattr(text, "response_template", None) is not None or getattr(text, "response_schema", None) is not None
        ):
            return [
                [parse_response(text, list(ids), prefix=list(prompt_ids[i]), tools=None)]
                for i, ids in enumerate(completion_ids)
            ]
        contents = tokenizer.batch_decode([list(c) for c in completion_ids], skip_special_tokens=True)
        return [[{"role": "assistant", "content": content}] for content in contents]
    return tokenizer.batch_decode([list(c) for c in completion_ids], skip_special_tokens=True)


def _as_rewards(values, name: str, expected: int, prompts, completions) -> list[float]:
    values = list(values)
    if len(values) != expected:
        raise RewardFunctionError(
            f"The reward function '{name}' returned {len(values)} rewards, but {expected} were expected (one per "
            f"prompt-completion pair). First prompt: {prompts[0]!r}"
        )
    return [torch.nan if v is None else float(v) for v in values]


class RewardScorer:
    """Scores rows with the trainer's reward functions, collecting ``log_extra``/``log_metric`` calls per call."""

    def __init__(
        self,
        reward_funcs: Sequence[Any],
        reward_processing_classes: Sequence[Any],
        reward_func_names: Sequence[str],
        chat_template_kwargs: dict,
        device: torch.device,
        trainer_state: Callable[[], Any],
        event_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.reward_funcs = list(reward_funcs)
        self.reward_processing_classes = list(reward_processing_classes)
        self.reward_func_names = list(reward_func_names)
        self.chat_template_kwargs = chat_template_kwargs
        self.device = device
        self.trainer_state = trainer_state
        # async rewards run on one long-lived loop, as in GRPOTrainer (loop-bound state such as a semaphore or an
        # async HTTP client survives from group to group): the trainer's loop when it has one, else our own
        self._given_loop = event_loop
        self._own_loop: tuple[threading.Thread, asyncio.AbstractEventLoop] | None = None

    def _run(self, awaitable) -> Any:
        loop = self._given_loop
        if loop is None:
            if self._own_loop is None:
                thread, loop, ready = start_event_loop_in_daemon(name="trl_async-rewards")
                ready.wait()
                self._own_loop = (thread, loop)
            loop = self._own_loop[1]
        return asyncio.run_coroutine_threadsafe(_await(awaitable), loop).result()

    def close(self) -> None:
        """Stop the loop this scorer started (a loop it was given belongs to its owner)."""
        if self._own_loop is not None:
            shutdown_event_loop_in_daemon(*self._own_loop)
            self._own_loop = None

    def score(
        self, rows: list[dict], completions: list, completion_ids: list, environments: list | None = None
    ) -> tuple[torch.Tensor, dict, dict]:
        """Returns ``rewards_NF`` (rows x reward functions, NaN where a function returned None), the extra columns
        and the metrics that reward functions logged during this call. ``environments`` (one instance per row) is
        passed on to the reward functions, as GRPOTrainer does."""
        # a row's images go into its messages, as GRPOTrainer gives reward functions the prompts it generated from
        prompts = [row["prompt"] if row_images(row) is None else prompt_with_images(row["prompt"], row_images(row))
                   for row in rows]  # fmt: skip
        extra_logs: dict[str, list] = defaultdict(list)
        metrics: dict[str, list] = defaultdict(list)
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [row[k] for row in rows] for k in keys}
        kwargs["trainer_state"] = self.trainer_state()
        kwargs["log_extra"] = lambda column, values: extra_logs[column].extend(values)
        kwargs["log_metric"] = lambda name, value: metrics[name].append(value)
        if environments is not None:
            kwargs["environments"] = environments
        completion_ids = [list(c) for c in completion_ids]

        rewards = torch.zeros(len(rows), len(self.reward_funcs))
        pending = {}  # index -> awaitable: async reward functions, awaited together (as GRPOTrainer gathers them)
        for i, (func, proc, name) in enumerate(
            zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names, strict=True)
        ):
            with _naming(name, prompts, completions):
                if isinstance(func, nn.Module):
                    rewards[:, i] = self._score_model(func, proc, prompts, completions)
                    continue
                out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
                if inspect.isawaitable(out):
                    pending[i] = out
                    continue
                rewards[:, i] = torch.tensor(_as_rewards(out, name, len(rows), prompts, completions))
        if pending:
            results = self._run(_gather(pending.values()))
            for i, out in zip(pending, results, strict=True):
                name = self.reward_func_names[i]
                with _naming(name, prompts, completions):
                    if isinstance(out, BaseException):
                        raise out
                    rewards[:, i] = torch.tensor(_as_rewards(out, name, len(rows), prompts, completions))
        unscored = torch.isnan(rewards).all(dim=1).nonzero().flatten().tolist()
        if unscored:
            warn_unscored(rows[unscored[0]], completions[unscored[0]], prompts[unscored[0]])
        return rewards, dict(extra_logs), dict(metrics)

    def _score_model(self, model: nn.Module, tokenizer, prompts: list, completions: list) -> torch.Tensor:
        if is_conversational({"prompt": prompts[0]}):
            messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
            texts = [apply_chat_template(x, tokenizer, **self.chat_template_kwargs)["text"] for x in messages]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        with torch.inference_mode():
            return model(**inputs).logits[:, 0].float().cpu()


def warn_unscored(row: dict, completion, prompt) -> None:
    """A row that every reward function scored None (GRPOTrainer's weighted ``nansum`` then makes its reward 0),
    warned about in the words GRPOTrainer uses, with the row's inputs, so that a filter on its warning sees it too."""
    inputs = {k: v for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
    inputs.update(prompt=prompt, completion=completion)
    logger.warning(
        "All reward functions returned None for the following kwargs:\n%s\nAt least one reward function must return a "
        "value for each completion.",
        inputs,
    )


async def _await(awaitable):
    return await awaitable


async def _gather(awaitables) -> list:
    """Every awaitable's result, or the exception it raised, run concurrently on the running loop."""
    return await asyncio.gather(*awaitables, return_exceptions=True)


@contextlib.contextmanager
def _naming(name: str, prompts: list, completions: list):
    """Re-raise what a reward function raised as ``RewardFunctionError`` naming it and showing the input."""
    try:
        yield
    except RewardFunctionError:
        raise
    except Exception as exc:
        raise RewardFunctionError(
            f"The reward function '{name}' raised {type(exc).__name__}: {exc}\n"
            f"  while scoring prompt {prompts[0]!r}\n  first completion {completions[0]!r}"
        ) from exc


def unsharded_reward_models(reward_funcs: Sequence[Any], dist, is_main_process: bool, device) -> list:
    """The reward functions the background scorer calls (on the main process). Under ZeRO-3 GRPOTrainer shards reward
    models with DeepSpeed, so each forward is a collective every rank must join, but the scorer runs on the main
    process's background thread, alone. So every rank calls this once (``dist``: TRL's ``DistributedBackend``),
    gathering each partitioned reward model, and the main process gets a plain copy in its place (the cost: one full
    reward model in its memory). Modules DeepSpeed did not partition, and functions, are returned as they are."""
    funcs = list(reward_funcs)
    if not dist.is_zero3:
        return funcs
    for i, func in enumerate(funcs):
        module = getattr(func, "module", func)  # the DeepSpeed engine's model
        if not (isinstance(module, nn.Module) and any(hasattr(p, "ds_id") for p in module.parameters())):
            continue
        with dist.gather_params(list(module.parameters())):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()} if is_main_process else None
        if state is None:
            continue
        from transformers.modeling_utils import set_zero3_state

        # transformers wraps a model built under ZeRO-3 in zero.Init (a collective, here on the main process alone:
        # a hang); marking zero.Init as already entered makes it build plain tensors
        with set_zero3_state():
            plain = type(module)(module.config)
        plain.load_state_dict(state)
        dtype = next(module.parameters()).dtype
        funcs[i] = plain.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return funcs


def with_extra_fields(row: dict, index: int, extra_fields: dict) -> dict:
    """GRPOTrainer's merge of rollout_func's extra fields into the inputs of completion ``index`` (a list gives its
    ``index``-th value when it has one, anything else is given as it is)."""
    row = dict(row)
    for key, values in extra_fields.items():
        if isinstance(values, list):
            if index < len(values):
                row[key] = values[index]
        else:
            row[key] = values
    return row


def reward_rows(group: RolloutGroup, row: dict, group_size: int) -> list[dict]:
    """The dataset row a reward function receives with each of a group's completions, as GRPOTrainer builds its
    inputs: each episode's own prompt where it has one (an environment's reset observation), and rollout_func's
    extra fields merged in."""
    rows = [{**row, "prompt": p} for p in group.row_prompts] if group.row_prompts else [row] * group_size
    if group.extra_fields:
        rows = [with_extra_fields(r, j, group.extra_fields) for j, r in enumerate(rows)]
    return rows


def group_scorer(new_scorer: Callable[[], RewardScorer], processing_class, group_size: int) -> tuple:
    """``(score_group, scorers)``: ``score_group`` for the pool's scoring threads, each of which gets its own scorer
    (``new_scorer()``) and tokenizer copy (a fast tokenizer used from two threads at once fails: "Already borrowed";
    the main thread keeps the trainer's, which evaluate() uses), and the list of those scorers, to close. Reward
    models and functions themselves are shared."""
    local = threading.local()
    scorers: list[RewardScorer] = []

    def own() -> tuple:
        if not hasattr(local, "scorer"):
            local.tokenizer = copy.deepcopy(processing_class)
            local.scorer = new_scorer()
            scorers.append(local.scorer)
        return local.tokenizer, local.scorer

    def score_group(group: RolloutGroup, row: dict, environments: list | None = None) -> ScoredGroup:
        tokenizer, scorer = own()
        rows = reward_rows(group, row, group_size)
        conversational = is_conversational({"prompt": rows[0]["prompt"]})
        prompt_ids = list(group.row_prompt_ids) or [group.prompt_ids] * group_size
        if group.completions:  # multi-turn: the parsed messages of each episode, as GRPOTrainer's loop builds them
            completions = [list(c) for c in group.completions]
        else:
            completions = decode_completions(tokenizer, prompt_ids, group.completion_ids, conversational)
        rewards, extra_logs, metrics = scorer.score(rows, completions, list(group.completion_ids), environments)
        return ScoredGroup(group, 0, rewards, extra_logs, metrics, row)

    return score_group, scorers


class PoolScoring:
    """The pool's scoring threads, mixed into ``RolloutPool``: each takes a finished group, drops it if it can no
    longer train (before its reward calls), scores it (``score_group``: ``group_scorer`` below) and queues it for
    ``take``, or gives its slot back when dynamic sampling rejects it. Reads the pool's ``_to_score``, ``_cv``,
    ``_ledger``, ``_rows``, ``_episodes``, ``_scoring``, ``_score_group``, ``_keep``, ``_tally``, ``_ready`` and
    ``_prompts``."""

    def _score_loop(self) -> None:
        """Score finished groups with the reward functions, one at a time per scoring thread (admission bounds how
        many can wait here)."""
        while not self._stop:
            try:
                group = self._to_score.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._cv:
                # dropped now, before its (possibly expensive) reward calls
                if self._ledger.too_stale_already(group.token_versions):
                    self.dropped_unscored += 1
                    self._drop_stale(group)
                    continue
                row = self._rows[group.group_id]
            started = time.time()
            environments = self._episodes.instances(group.group_id) if self._episodes is not None else None
            with self._cv:
                self._scoring[group.group_id] = time.monotonic()
            try:
                scored = self._score_group(group, row, environments)
            finally:
                with self._cv:
                    del self._scoring[group.group_id]
                if environments is not None:
                    self._episodes.release(group.group_id)
            self.activity.append(("score", group.lane_id, started, time.time()))
            with self._cv:
                self._abandoned_in_a_row = 0
                self._tally.tokens += group.num_sampled_tokens
                if self._keep is not None:
                    if not self._keep(scored.rewards):
                        if self._ledger.too_stale_already(group.token_versions):
                            self._drop_stale(group)  # went stale while scored: generated again, as any stale group
                        else:
                            self._filter(group)
                        continue
                    self._tally.kept += 1
                self._ready.append(scored)
                self._cv.notify_all()

    def _scoring_state(self) -> str:
        """Where finished groups are in scoring (a hung reward function shows here, not as a worker fault)."""
        started = list(self._scoring.values())
        longest = f", the longest for {time.monotonic() - min(started):.0f}s" if started else ""
        waiting = self._to_score.qsize()
        return f"{len(started)} group(s) inside reward functions{longest}; {waiting} waiting to be scored"

    def _filter(self, group: RolloutGroup) -> None:
        """Dynamic sampling: ``group`` has no signal. Its admission slot goes to a new prompt; its own prompt is done
        for the stream and for resuming, whatever a checkpoint's step (a checkpoint reads the stream when it is saved,
        so it counts only what was filtered before). Caller holds the lock."""
        self._ledger.give_back()
        self.filtered_groups += 1
        self._tally.filtered += 1
        self._prompts.taken([self._forget(group.group_id)], -(2**62))
        self._cv.notify_all()
