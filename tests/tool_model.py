"""A tiny tool-calling model, built offline: a BPE tokenizer with Qwen3's chat template (TRL parses its tool calls)
and a tiny Qwen2 fitted so that its greedy turn for each prompt is a fixed tool call (or plain text), and its turn
after any tool result is "Done!". Real tool calls then flow through real rollout workers.

The scenarios are TRL's own (tests/test_grpo_trainer.py::test_training_with_tools): a valid call, a call with an
argument the tool does not take, plain text; plus an unknown tool and a malformed call.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template

from trl_async.tiny import build_tiny_model, build_tool_tokenizer, fit_sequences, render_text


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def _multiply_async(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


_multiply_async.__name__ = _multiply_async.__qualname__ = "multiply"  # the same tool, rendered into the prompt identically, awaited on a loop
multiply_async = _multiply_async


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


def build_tool_model(path: str | Path, tools=(multiply,), fit_steps: int = 400) -> Path:
    path = Path(path)
    tools = list(tools)
    corpus = []
    for prompt, first in FIRST_TURNS.items():
        corpus.append(render_text(conversation(prompt), tools, add_generation_prompt=True) + first + "<|im_end|>")
        result = TOOL_RESULTS.get(prompt, "0")
        corpus.append(
            render_text(conversation(prompt) + [{"role": "assistant", "content": first},
                        {"role": "tool", "name": "multiply", "content": result}], tools, add_generation_prompt=True)
            + AFTER_TOOL + "<|im_end|>"
        )  # fmt: skip
    tokenizer = build_tool_tokenizer(corpus)
    template = get_training_chat_template(tokenizer)
    owner = SimpleNamespace(_is_vlm=False, processing_class=tokenizer, _tokenizer=tokenizer, chat_template=template,
                            chat_template_kwargs={})  # fmt: skip
    sequences = []
    for prompt, first in FIRST_TURNS.items():
        context = tokenizer.apply_chat_template(conversation(prompt), tools=tools, chat_template=template,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
        turn = tokenizer.encode(first + "<|im_end|>", add_special_tokens=False)
        sequences.append((list(context), turn))
        for result in (TOOL_RESULTS.get(prompt, "0"), "12", "{'error': 'x'}"):  # "Done!" after any tool result
            suffix = GRPOTrainer._get_tool_suffix_ids(owner, [{"role": "tool", "name": "multiply", "content": result}])
            done = tokenizer.encode(AFTER_TOOL + "<|im_end|>", add_special_tokens=False)
            sequences.append((list(context) + turn + list(suffix), done))
    longest = max(len(c) + len(t) for c, t in sequences)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, max_position_embeddings=4 * longest)
    loss = fit_sequences(model, sequences, steps=fit_steps)
    if loss > 0.05:
        raise RuntimeError(f"the tiny tool-calling model did not fit its turns (loss {loss:.3f})")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
