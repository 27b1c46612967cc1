"""Multi-turn rollouts with `tools`: real tool calls from a tiny fitted model, through real rollout workers, checked
against TRL's own GRPOTrainer on the same model (its tool-calling scenarios) and against what GRPOTrainer's loop
builds token by token."""

from __future__ import annotations

import threading
import time

import pytest
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer

from .conftest import async_args, no_rollout_children
from .tool_model import (
    AFTER_TOOL,
    FIRST_TURNS,
    TOOL_RESULTS,
    build_tool_model,
    conversation,
    multiply,
    multiply_async,
)

# TRL's scenario: a valid call, a call with an argument the tool does not take, plain text
TRL_PROMPTS = ["What is 3 times 4?", "What is 5 times 6?", "Say hello."]
TOOL_SETTINGS = dict(
    per_device_train_batch_size=6, num_generations=2, max_completion_length=48, temperature=0.1,
    learning_rate=1e-6, max_steps=2, logging_steps=1, report_to=[], bf16=False, use_cpu=True,
    gradient_checkpointing=False, save_strategy="no", beta=0.0,
)  # fmt: skip


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    return str(build_tool_model(tmp_path_factory.mktemp("tool_model")))


def tokenizer_of(path: str) -> PreTrainedTokenizerFast:
    # transformers 5 loads a Qwen2 model's tokenizer as Qwen2Tokenizer, which replaces the saved pre-tokenizer; the
    # generic class keeps the BPE this model was fitted with
    return PreTrainedTokenizerFast.from_pretrained(path)


def dataset(prompts) -> Dataset:
    return Dataset.from_list([{"prompt": conversation(p)} for p in prompts])


class Recorder:
    """A reward function that keeps what it was given (completions as messages) and rewards "Done!"."""

    def __init__(self):
        self.seen: list[tuple[list, list]] = []
        self.lock = threading.Lock()
        self.__name__ = "done_reward"

    def __call__(self, prompts, completions, **kwargs):
        with self.lock:
            self.seen.append((prompts, completions))
        return [float(any(m.get("content") == AFTER_TOOL for m in c)) for c in completions]


def tool_metrics(trainer) -> list[tuple[float, float]]:
    return [(h["tools/call_frequency"], h["tools/failure_frequency"]) for h in trainer.state.log_history
            if "tools/call_frequency" in h]  # fmt: skip


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_trl_tool_scenarios_give_grpo_trainers_metrics_and_messages(tmp_path, tool_model_dir, kind):
    tools = [multiply] if kind == "sync" else [multiply_async]
    reference = Recorder()
    sync = GRPOTrainer(model=tool_model_dir, reward_funcs=reference, processing_class=tokenizer_of(tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **TOOL_SETTINGS),
                       train_dataset=dataset(TRL_PROMPTS), tools=tools)  # fmt: skip
    sync.train()
    recorder = Recorder()
    # max_staleness=0: each step trains on the groups of one generation batch, as GRPOTrainer does (with staleness,
    # single-turn groups finish first and batches mix generation batches)
    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                               args=async_args(tmp_path / "async", **TOOL_SETTINGS, max_staleness=0),
                               train_dataset=dataset(TRL_PROMPTS), tools=tools)  # fmt: skip
    trainer.train()

    # TRL's expectation for these three prompts: 4 calls in 6 rollouts, 2 of them failed
    assert tool_metrics(sync) == [(pytest.approx(2 / 3), 0.5)] * 2
    assert tool_metrics(trainer) == tool_metrics(sync)
    # reward functions get the same messages GRPOTrainer gives them: call, tool result, answer
    by_prompt = lambda seen: {p[-1]["content"]: c for ps, cs in seen for p, c in zip(ps, cs, strict=True)}  # noqa: E731
    ours, theirs = by_prompt(recorder.seen), by_prompt(reference.seen)
    assert set(ours) == set(TRL_PROMPTS)
    for prompt in TRL_PROMPTS:
        assert ours[prompt] == theirs[prompt], prompt
    assert [m["role"] for m in ours["What is 3 times 4?"]] == ["assistant", "tool", "assistant"]
    assert ours["What is 3 times 4?"][1]["content"] == "12"
    assert ours["What is 5 times 6?"][1]["content"] == TOOL_RESULTS["What is 5 times 6?"]
    assert ours["Say hello."] == [{"role": "assistant", "content": FIRST_TURNS["Say hello."]}]
    assert no_rollout_children()

