"""Environments (``environment_factory``) as the episode runner uses them: a pool of instances reused across episodes,
their methods as tools, and ``reset``'s observation added to the prompt, by GRPOTrainer's rules."""

from __future__ import annotations

import inspect
import threading


class EnvironmentPool:
    """Environment instances per name (``None``: the single factory), created on demand and reused."""

    def __init__(self, factories: dict) -> None:
        self.factories = factories
        self._free: dict = {name: [] for name in factories}
        self._lock = threading.Lock()

    def acquire(self, name):
        with self._lock:
            if self._free[name]:
                return self._free[name].pop()
        return self.factories[name]()

    def release(self, name, instances) -> None:
        with self._lock:
            self._free[name].extend(instances)


def environment_tools(instance) -> list:
    """The methods GRPOTrainer exposes as tools: public functions of the class but ``reset`` and ``get_reward``."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def with_observation(prompt: list[dict], observation) -> list[dict]:
    """GRPOTrainer's rule: ``reset``'s return value is appended to the content of the last prompt message."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
