"""One decode step of a transformers worker's ``generate``, as the trainer rebuilds it: the sampling warpers moved
out of ``generate`` into a hook that applies them, records each step's policy version and the log-prob of the token
sampled; and the left padding both engines (static batches, the slot loop) give their rows."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...correction.sampling import processors, settings_of

NEUTRAL_SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0,
                        eta_cutoff=0.0, top_h=None, repetition_penalty=1.0)  # fmt: skip


def split_sampling_warpers(config: Any, device: torch.device | str = "cpu") -> tuple[Any, Any]:
    """``(config without the sampling settings, their processors)``: the same sampling distribution, with the
    repetition penalty and the warpers (temperature, top-k/p, min-p, ...) moved out of ``generate`` so the decode
    hook applies them itself, as the trainer rebuilds them (``sampling.processors``), and sees the final, sampled-from
    scores. ``generate`` applies its remaining processors first, as it would have."""
    from transformers import LogitsProcessorList

    if not config.do_sample:
        return config, LogitsProcessorList()
    chain = processors(settings_of("transformers", config.to_dict()), device)
    stripped = copy.deepcopy(config)
    for name, value in NEUTRAL_SAMPLING.items():
        setattr(stripped, name, value)
    return stripped, chain


class DecodeStepHook:
    """The last logits processor of ``generate``. Per decode step it applies the sampling warpers, records the version
    of the weights whose forward produced the logits, and keeps log-softmax of the final scores until the next step
    reveals which token was sampled from them: behaviour log-probs cost O(rows x steps) memory, never one
    full-vocabulary score tensor per step. In in-flight mode it adopts newer weights afterwards, so the next step
    uses them."""

    def __init__(
        self,
        warpers,
        current_version: Callable[[], int],
        between_steps: Callable[[], None] | None,
        padding: torch.Tensor | None = None,
    ) -> None:
        self.warpers = warpers
        self.padding = padding  # (rows, prompt width) bool: the left padding, which no row has seen
        self.current_version = current_version
        self.between_steps = between_steps
        self.step_versions: list[int] = []
        self.step_logprobs: list[torch.Tensor] = []  # (rows,) per step, float32
        self._pending: torch.Tensor | None = None  # log-softmax of the last step's final scores

    def take_sampled(self, sampled: torch.Tensor) -> None:
        """Log-prob of the tokens sampled from the pending step's distribution."""
        if self._pending is not None:
            self.step_logprobs.append(self._pending.gather(-1, sampled.view(-1, 1)).squeeze(-1).cpu())
            self._pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take_sampled(input_ids[:, -1])  # the previous step's token is now the last input
        if self.padding is not None and self.padding.any():  # an id past the vocabulary: the penalty skips it
            input_ids = input_ids.clone()
            width = self.padding.size(1)
            input_ids[:, :width] = input_ids[:, :width].masked_fill(self.padding, scores.size(-1))
        scores = self.warpers(input_ids, scores)
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        self.step_versions.append(self.current_version())
        if self.between_steps is not None:
            self.between_steps()
        return scores


def left_padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` left-padded to the longest one."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask
