"""An agent's episode as the training sample it becomes, from the requests it sent to the endpoint.

Each request is recorded with the exact tokens: the prompt as the chat template rendered it, the completion as
sampled, each completion token's behaviour log-prob (mu) and policy version. A request whose prompt starts with the
previous request's whole sequence (its prompt and completion) extends the episode: what the agent added in between
(tool results, user turns, the template's own separators) joins the sample as masked tokens, and the new completion
as trained ones. A request that does not (the agent truncated, summarised or rewrote its history, or the template
renders an earlier turn differently from the tokens sampled) starts a new segment. A GRPO group holds one sample per
episode, so an episode trains its last segment, the one that ends with the agent's answer; the earlier segments are
counted (``segments - 1``) and not trained on. Nothing here re-tokenizes text: every trained token is one the model
sampled, with its own mu and version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One chat-completions request: the rendered prompt and what was sampled for it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """An episode's trained sample: ``env_mask`` 1 for a sampled token, 0 for one the agent added between requests
    (its log-prob a 0.0 placeholder, its version that of the sampled token before it)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    env_mask: tuple[int, ...]
    versions: tuple[int, ...]
    segments: int  # 1: every request extended the one before


def extends(request: Request, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> bool:
    """Whether ``request``'s prompt starts with the sequence ``prompt_ids + completion_ids`` (strictly longer is not
    needed: an agent may send the same context again)."""
    sequence = (*prompt_ids, *completion_ids)
    return len(request.prompt_ids) >= len(sequence) and request.prompt_ids[: len(sequence)] == sequence


def assemble(requests: Sequence[Request]) -> Sample:
    """The sample an episode trains on (see the module's docstring). ``requests`` in the order they were sent; at
    least one."""
    if not requests:
        raise ValueError("an episode with no request has nothing to train on")
    prompt: tuple[int, ...] = ()
    completion: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: list[int] = []
    segments = 0
    for request in requests:
        if segments and extends(request, prompt, completion):
            added = request.prompt_ids[len(prompt) + len(completion) :]
            last = versions[-1] if versions else 0
            completion += added
            logprobs += [0.0] * len(added)
            mask += [0] * len(added)
            versions += [last] * len(added)
        else:  # the first request, or history rewritten: a new segment starts here
            segments += 1
            prompt, completion, logprobs, mask, versions = request.prompt_ids, [], [], [], []
        completion += request.completion_ids
        logprobs += request.logprobs
        mask += [1] * len(request.completion_ids)
        versions += request.versions
    return Sample(prompt, tuple(completion), tuple(logprobs), tuple(mask), tuple(versions), segments)


def budget_left(requests: Sequence[Request], prompt_ids: Sequence[int], max_completion_length: int) -> int:
    """How many tokens a request with ``prompt_ids`` may sample: ``max_completion_length`` bounds the sample's whole
    completion (sampled and added tokens), as GRPOTrainer bounds a multi-turn episode's."""
    if not requests:
        return max_completion_length
    sample = assemble(requests)
    request = Request(tuple(prompt_ids), (), (), ())
    if not extends(request, sample.prompt_ids, sample.completion_ids):
        return max_completion_length  # a new segment
    return max_completion_length - (len(prompt_ids) - len(sample.prompt_ids))
