"""The calls into GRPOTrainer's private methods made from outside a GRPOTrainer method, in one place. Each is pinned
by tests/unit/test_grpo_private.py against the installed TRL, so a release that renames a method, changes its
parameters or reads another attribute fails there, not in a background thread at run time."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

# what GRPOTrainer._get_tool_suffix_ids reads of the trainer: a stand-in with these renders with another tokenizer
SUFFIX_OWNER_ATTRIBUTES = ("_is_vlm", "processing_class", "_tokenizer", "chat_template", "chat_template_kwargs")


class ToolSuffix:
    """GRPOTrainer's token ids for tool results appended to a conversation (``_get_tool_suffix_ids``), rendered with
    a tokenizer of one's own: the episode runner's copy (a fast tokenizer must not serve two threads at once), or a
    test model's."""

    def __init__(self, tokenizer, chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        self._owner = SimpleNamespace(
            _is_vlm=False,
            processing_class=tokenizer,
            _tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs or {},
        )

    def ids(self, messages: Sequence[dict]) -> list[int]:
        from trl import GRPOTrainer

        return GRPOTrainer._get_tool_suffix_ids(self._owner, list(messages))


def generate_single_turn(trainer, prompt_ids: Sequence[Sequence[int]]) -> list:
    """GRPOTrainer's own generation with the trainer's model, one completion per prompt, bypassing
    AsyncGRPOTrainer's override (``_generate_single_turn``): the completion ids."""
    from trl import GRPOTrainer

    completion_ids, _ = GRPOTrainer._generate_single_turn(trainer, [list(p) for p in prompt_ids], None, {}, 1)
    return completion_ids
