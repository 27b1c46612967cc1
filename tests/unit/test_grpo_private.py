"""The GRPOTrainer private methods called from outside a GRPOTrainer method (trl_async/rollout/grpo_private.py),
pinned against the installed TRL: their parameters, and what ``_get_tool_suffix_ids`` reads of the trainer (the
stand-in provides exactly that). A TRL release that changes either fails here."""

import inspect
import re

from trl import GRPOTrainer

from trl_async.rollout.grpo_private import SUFFIX_OWNER_ATTRIBUTES, ToolSuffix


def attributes_read(method) -> set[str]:
    return set(re.findall(r"\bself\.(\w+)", inspect.getsource(method)))


def test_the_tool_suffix_reads_only_what_the_stand_in_has():
    assert attributes_read(GRPOTrainer._get_tool_suffix_ids) <= set(SUFFIX_OWNER_ATTRIBUTES)
    assert list(inspect.signature(GRPOTrainer._get_tool_suffix_ids).parameters) == ["self", "tool_messages"]


def test_the_stand_in_catches_a_method_that_reads_more():
    """The check above, on a planted method that reads one attribute more."""

    def _get_tool_suffix_ids(self, tool_messages):
        return self.processing_class, self._processor

    assert attributes_read(_get_tool_suffix_ids) - set(SUFFIX_OWNER_ATTRIBUTES) == {"_processor"}


def test_generate_single_turn_takes_what_it_is_given():
    parameters = list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)
    assert parameters[:5] == ["self", "prompt_ids", "images", "multimodal_fields", "num_generations"]


def test_the_tool_suffix_renders_as_grpo_trainer_does():
    from trl.chat_template_utils import get_training_chat_template

    from trl_async.demo.tiny import build_tool_tokenizer, render_text

    tools = []
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    tokenizer = build_tool_tokenizer([render_text(messages, tools, add_generation_prompt=True) + "x<|im_end|>"])
    template = get_training_chat_template(tokenizer)
    tool = [{"role": "tool", "name": "f", "content": "42"}]
    ids = ToolSuffix(tokenizer, template, {}).ids(tool)
    assert ids and tokenizer.decode(ids).count("42") == 1
