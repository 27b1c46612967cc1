"""Agents written for any framework, trained through an OpenAI-compatible endpoint: ``episode.py`` (an episode's
requests as its training sample), ``endpoint.py`` (the loopback chat-completions server), ``rollout.py``
(``agent_rollout``, the ``rollout_func`` that runs the agents). ``from trl_async.agents import agent_rollout,
agent_reward``."""

from .rollout import agent_reward, agent_rollout

__all__ = ["agent_reward", "agent_rollout"]
