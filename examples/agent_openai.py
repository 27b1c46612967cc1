"""Train an agent written against the official `openai` client, through trl_async's OpenAI-compatible endpoint.

Runs on a CPU, offline: it fits a tiny tool-calling model first (about a minute), then trains it for a few steps.
The agent below is an ordinary tool-calling loop; nothing in it knows about training. Each episode gets a base URL
of its own, whose requests are sampled by the rollout workers and recorded with their exact tokens.

    python examples/agent_openai.py
"""

from __future__ import annotations

import json

from openai import OpenAI
from transformers.utils import get_json_schema


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


TOOLS = [get_json_schema(multiply)]  # the OpenAI function schema


def agent(prompt: list[dict], base_url: str) -> float:
    """One episode: ask, run the tool calls the model makes, send their results back, until it answers. Returns the
    episode's reward."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = list(prompt)
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = str(multiply(**json.loads(call.function.arguments)))
            except (TypeError, ValueError) as exc:
                result = str({"error": str(exc)})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float("Done!" in (message.content or ""))


def tiny_tool_model(path: str) -> str:
    """A tiny model fitted to call `multiply` for these prompts and to say "Done!" after a tool result."""
    from trl_async.demo.tiny import build_tool_model

    call = lambda **arguments: f"<tool_call>\n{json.dumps({'name': 'multiply', 'arguments': arguments})}\n</tool_call>"  # noqa: E731
    episodes = {
        "What is 3 times 4?": [(call(a=3, b=4), ["12"]), ("Done!", [])],
        "What is 6 times 7?": [(call(a=6, b=7), ["42"]), ("Done!", [])],
        "Say hello.": [("Hello!", [])],
    }
    return str(build_tool_model(path, episodes, [multiply]))


def main(output_dir: str = "outputs/agent_openai") -> None:
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.agents import agent_reward, agent_rollout

    torch.set_num_threads(1)
    model = tiny_tool_model(f"{output_dir}/model")
    prompts = ["What is 3 times 4?", "What is 6 times 7?", "Say hello."]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
    args = AsyncGRPOConfig(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=48, temperature=0.7, learning_rate=1e-5, logging_steps=1, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no",
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=model,
        processing_class=PreTrainedTokenizerFast.from_pretrained(model),
        reward_funcs=agent_reward,  # the number each episode's agent returned
        args=args,
        train_dataset=dataset,
        rollout_func=agent_rollout(agent, timeout_s=120),
    )
    trainer.train()
    for log in trainer.state.log_history:
        if "reward" in log:
            print(f"step {log['step']}: reward {log['reward']:.2f}, ratio max {log['is/ratio_max']:.3f}")


if __name__ == "__main__":
    main()
