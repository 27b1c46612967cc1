"""A tiny tool-calling model, built offline: a BPE tokenizer with Qwen3's chat template (TRL parses its tool calls)
and a tiny Qwen2 fitted so that its greedy turn for each prompt is a fixed tool call (or plain text), and its turn
after any tool result is "Done!". Real tool calls then flow through real rollout workers.

The scenarios are TRL's own (tests/test_grpo_trainer.py::test_training_with_tools): a valid call, a call with an
argument the tool does not take, plain text; plus an unknown tool and a malformed call.
"""

from __future__ import annotations

import json
from pathlib import Path

from trl_async.demo import tiny

MULTIPLY_DOC = """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """


def as_multiply(fn):
    """Give ``fn`` the name and docstring the model was fitted on, so the prompt renders the same tool schema (a
    function's schema comes from its name, type hints and docstring)."""
    fn.__doc__ = MULTIPLY_DOC
    fn.__name__ = fn.__qualname__ = "multiply"
    return fn


@as_multiply
def multiply(a: int, b: int) -> int:
    return a * b


@as_multiply
async def multiply_async(a: int, b: int) -> int:  # the same tool, awaited on an event loop
    return a * b


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# prompt -> the model's first turn (all end with <|im_end|>); after a tool result it says "Done!"
FIRST_TURNS = {
    "What is 3 times 4?": call("multiply", a=3, b=4),  # valid: the tool returns 12
    "What is 5 times 6?": call("multiply", a=5, c=6),  # a keyword the tool does not take: a failed call
    "Say hello.": "I don't know any tool",  # plain text: no call
    "What is 8 over 2?": call("divide", a=8, b=2),  # an unknown tool: a failed call
    "What is 7 times 7?": '<tool_call>\n{"name": "multiply", "arguments": {"a": 7,\n</tool_call>',  # malformed
}
AFTER_TOOL = "Done!"
TOOL_RESULTS = {"What is 3 times 4?": "12", "What is 5 times 6?": "{'error': \"multiply() got an unexpected keyword "
                "argument 'c'\"}", "What is 8 over 2?": "{'error': 'Tool divide not found.'}"}  # fmt: skip


def conversation(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def build_tool_model(path: str | Path, tools=(multiply,), fit_steps: int = 400, **model_kwargs) -> Path:
    """The scenarios above: after a call, "Done!" whatever the tool returned (its own result, 12, or an error).
    ``model_kwargs``: the tiny model's size (``hidden_size``, ``num_heads``; vLLM's CPU attention needs heads of 64)."""
    episodes = {
        prompt: [(first, [TOOL_RESULTS.get(prompt, "0"), "12", "{'error': 'x'}"]), (AFTER_TOOL, [])]
        for prompt, first in FIRST_TURNS.items()
    }
    return tiny.build_tool_model(path, episodes, list(tools), fit_steps=fit_steps, **model_kwargs)
