"""``agent_rollout``: train an agent written for any framework, through the OpenAI-compatible endpoint.

The user writes one function, ``agent(prompt, base_url)``, that runs an episode against a chat-completions API at
``base_url`` (the ``openai`` client, smolagents, LangGraph, a loop of one's own) and returns its reward (a number), or
a dict of fields for the reward functions. ``agent_rollout(agent)`` is a ``rollout_func``: for each admitted group
it runs ``num_generations`` episodes of the group's prompt at once, each on threads of its own with a base URL of its
own, and hands the trainer one sample per episode with the exact tokens sampled (``episode.py``). ``async def``
agents run on an event loop of their own per episode.

An episode that raises, outlives ``timeout_s``, sends no request, or floods the endpoint ends its group: GRPO
normalises rewards within a group, so a group with an episode missing is not trained on. It is abandoned and counted
(``async/abandoned_groups``), its prompt not retried, and training goes on. An episode still running after its
timeout keeps its thread (Python cannot stop one) but its base URL answers 404 from then on.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import queue
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait

from ..rollout.rollout_func import GroupAbandoned
from .endpoint import Endpoint, with_response_schema
from .episode import assemble

REWARD_FIELD = "agent_reward"


def agent_reward(completions, agent_reward, **kwargs) -> list[float]:
    """The reward function for agents that return a number: the number each episode returned."""
    return [float(r) for r in agent_reward]


RESERVED = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "policy_version", "agent_segments")


class agent_rollout:  # noqa: N801 - used as a function: ``rollout_func=agent_rollout(agent)``
    """A ``rollout_func`` running ``agent(prompt, base_url)`` per episode. ``timeout_s``: an episode's wall clock
    (below the trainer's ``rollout_timeout_s``, which bounds the trainer's wait for a batch); ``max_requests``: the
    requests one episode may send. ``episodes``: the requests of the last ``keep`` episodes, newest last, for
    inspection. Closed with the rollouts when training ends."""

    def __init__(self, agent: Callable, timeout_s: float = 120.0, max_requests: int = 64, keep: int = 64) -> None:
        if not callable(agent):
            raise ValueError(f"agent must be a function agent(prompt, base_url) -> reward, got {type(agent).__name__}")
        if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(max_requests, int) and max_requests >= 1):
            raise ValueError(f"max_requests must be a positive integer, got {max_requests!r}")
        if not (isinstance(keep, int) and keep >= 0):
            raise ValueError(f"keep must be a whole number of episodes, got {keep!r}")
        self.agent, self.timeout_s, self.max_requests, self.keep = agent, float(timeout_s), max_requests, keep
        self.episodes: list = []
        self._endpoint: Endpoint | None = None
        self._lock = threading.Lock()
        self._tokenizers: queue.SimpleQueue = queue.SimpleQueue()  # copies, one per running episode, reused

    def _endpoint_now(self) -> Endpoint:
        with self._lock:
            if self._endpoint is None:  # started with the first group; serves every later one
                self._endpoint = Endpoint()
            return self._endpoint

    def close(self) -> None:
        """Stop the endpoint (a later group starts another)."""
        with self._lock:
            endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()

    def __call__(self, prompts: list, trainer) -> dict:
        check_trainer(trainer, self.timeout_s)
        endpoint = self._endpoint_now()
        tokenizers = [self._tokenizer(trainer.processing_class) for _ in prompts]
        opened = [
            endpoint.open(
                generate=trainer.rollout_generate,
                tokenizer=tokenizer,
                chat_template=trainer.chat_template,  # the trainer's rendering (None: the tokenizer's own)
                chat_template_kwargs=dict(trainer.chat_template_kwargs or {}),
                max_completion_length=trainer.max_completion_length,
                max_requests=self.max_requests,
                stop_ids=tuple(int(i) for i in trainer.eos_token_ids),
            )
            for tokenizer in tokenizers
        ]
        try:
            results = self._run_all(prompts, [url for _, url in opened])
        finally:
            recorded = [endpoint.close_episode(episode) for episode, _ in opened]
            for tokenizer in tokenizers:  # an episode's requests are over once it is closed
                self._tokenizers.put(tokenizer)
            if self.keep:
                with self._lock:
                    self.episodes = [*self.episodes, *recorded][-self.keep :]
        for i, (episode, _) in enumerate(opened):
            if episode.refused is not None:
                raise GroupAbandoned(f"episode {i} sent {episode.refused}")
            if not recorded[i]:
                raise GroupAbandoned(f"episode {i} sent no request to its endpoint: nothing to train on")
        samples = [assemble(requests) for requests in recorded]
        output = {
            "prompt_ids": [list(s.prompt_ids) for s in samples],
            "completion_ids": [list(s.completion_ids) for s in samples],
            "logprobs": [list(s.logprobs) for s in samples],
            "env_mask": [list(s.env_mask) for s in samples],
            "policy_version": [list(s.versions) for s in samples],
            "agent_segments": [s.segments for s in samples],
        }
        for name in results[0]:
            output[name] = [r[name] for r in results]
        return output

    def _tokenizer(self, processing_class):
        """A tokenizer copy for one episode (a fast tokenizer is not shared across threads), parsing tool calls:
        one released by an earlier episode, or a new one (a copy costs a real tokenizer tens of milliseconds)."""
        try:
            return self._tokenizers.get_nowait()
        except queue.Empty:
            return with_response_schema(processing_class)

    def _run_all(self, prompts: list, urls: list[str]) -> list[dict]:
        """Every episode at once, each on its own thread; their results as dicts of reward fields. The first
        failure ends the group at once."""
        futures = [Future() for _ in prompts]
        for i, (prompt, url) in enumerate(zip(prompts, urls, strict=True)):
            threading.Thread(target=self._run_one, args=(prompt, url, futures[i]), daemon=True,
                             name=f"trl_async-agent-{i}").start()  # fmt: skip
        done, pending = wait(futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for i, future in enumerate(futures):
            if future in done and future.exception() is not None:
                exc = future.exception()
                raise GroupAbandoned(f"episode {i}'s agent raised {exc!r}") from exc
        if pending:
            raise GroupAbandoned(f"{len(pending)} episode(s) ran past timeout_s={self.timeout_s:g}")
        results = [reward_fields(future.result(), i) for i, future in enumerate(futures)]
        if any(set(r) != set(results[0]) for r in results):
            raise ValueError(f"the agent returned different fields for the episodes of one group: {results}")
        return results

    def _run_one(self, prompt, url: str, future: Future) -> None:
        try:
            result = self.agent(copy.deepcopy(prompt), url)
            if inspect.isawaitable(result):  # an async agent (or one that returns a coroutine): its own event loop
                result = asyncio.run(_awaited(result))
            future.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - reported to the group's thread
            future.set_exception(exc)


async def _awaited(awaitable):
    return await awaitable


def check_trainer(trainer, timeout_s: float) -> None:
    """What the endpoint needs of the trainer: a text model (a processor's image prompts are not rendered here) and
    a wait for batches longer than an episode."""
    from transformers import ProcessorMixin

    if isinstance(trainer.processing_class, ProcessorMixin):
        raise ValueError("agent_rollout serves text models: a vision-language processor is not supported")
    limit = getattr(getattr(trainer, "async_args", None), "rollout_timeout_s", None)
    if limit is not None and timeout_s >= limit:
        raise ValueError(
            f"agent_rollout(timeout_s={timeout_s:g}) must be below rollout_timeout_s={limit:g}, the trainer's wait for "
            "a batch: raise rollout_timeout_s or lower timeout_s"
        )


def reward_fields(result, index: int) -> dict:
    """What an agent returned, as fields for the reward functions: a number is ``agent_reward``."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return {REWARD_FIELD: float(result)}
    if isinstance(result, dict) and result and all(isinstance(k, str) for k in result):
        taken = sorted(set(result) & set(RESERVED))
        if taken:
            raise ValueError(f"episode {index}: the agent returned fields named {taken}, which the trainer uses")
        return dict(result)
    raise ValueError(
        f"episode {index}: the agent returned {result!r}; return its reward (a number) or a dict of fields for the "
        "reward functions"
    )
