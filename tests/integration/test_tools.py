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

from ..conftest import async_args, no_rollout_children
from ..tool_model import (
    AFTER_TOOL,
    FIRST_TURNS,
    TOOL_RESULTS,
    as_multiply,
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


class _KeepLoopOutputs:
    """Mixin: keep what `_tool_call_loop` returned (per rollout: tool mask, messages, completion ids)."""

    def _tool_call_loop(self, *args, **kwargs):
        keys = [prompt[-1]["content"] for prompt in args[0]]  # GRPOTrainer's loop appends to the prompts
        out = super()._tool_call_loop(*args, **kwargs)
        self.loop_outputs = getattr(self, "loop_outputs", [])
        for key, mask, ids in zip(keys, out[0], out[2], strict=True):
            self.loop_outputs.append((key, list(ids), list(mask)))
        return out


class KeepingGRPOTrainer(_KeepLoopOutputs, GRPOTrainer):
    pass


class KeepingAsyncGRPOTrainer(_KeepLoopOutputs, AsyncGRPOTrainer):
    pass


def test_episode_tokens_and_tool_mask_equal_grpo_trainers(tmp_path, tool_model_dir):
    """prompt + turn + tool suffix + turn, token for token, with the suffix masked, as GRPOTrainer's loop builds them;
    also an unknown tool (a failed call) and a malformed call (no call: the episode ends)."""
    prompts = ["What is 3 times 4?", "What is 8 over 2?", "What is 7 times 7?", "Say hello."]
    settings = {**TOOL_SETTINGS, "per_device_train_batch_size": 8, "max_steps": 1}
    tokenizer = tokenizer_of(tool_model_dir)
    sync = KeepingGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer,
                              args=GRPOConfig(output_dir=str(tmp_path / "sync"), **settings),
                              train_dataset=dataset(prompts), tools=[multiply])  # fmt: skip
    sync.train()
    ours = KeepingAsyncGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer,
                                   args=async_args(tmp_path / "async", **settings, max_staleness=0),
                                   train_dataset=dataset(prompts), tools=[multiply])  # fmt: skip
    ours.train()
    theirs = {p: (ids, mask) for p, ids, mask in sync.loop_outputs}
    mine = {p: (ids, mask) for p, ids, mask in ours.loop_outputs}
    assert set(mine) == set(prompts) and mine == theirs
    # the suffix is exactly the masked span, and it holds the tool's result
    ids, mask = mine["What is 3 times 4?"]
    suffix = [t for t, m in zip(ids, mask, strict=True) if m == 0]
    assert 0 < len(suffix) < len(ids) and "<tool_response>\n12\n</tool_response>" in tokenizer.decode(suffix)
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 1]).endswith(AFTER_TOOL + "<|im_end|>")
    assert "Tool divide not found." in tokenizer.decode(mine["What is 8 over 2?"][0])
    assert all(m == 1 for m in mine["What is 7 times 7?"][1])  # malformed: no call, nothing appended
    # 4 calls in 8 rollouts (multiply twice, divide twice), the 2 divide calls failed
    assert tool_metrics(ours) == tool_metrics(sync) == [(0.5, 0.5)]


def test_episodes_wait_for_tools_concurrently(tmp_path, tool_model_dir):
    """While one episode waits for its tool, others run theirs: the calls' time spans overlap."""
    spans, lock = [], threading.Lock()

    @as_multiply
    def multiply(a: int, b: int) -> int:
        start = time.time()
        time.sleep(0.4)
        with lock:
            spans.append((start, time.time()))
        return a * b

    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                               args=async_args(tmp_path, **TOOL_SETTINGS, rollout_tool_threads=4),
                               train_dataset=dataset(["What is 3 times 4?", "Say hello.", "What is 5 times 6?"]),
                               tools=[multiply])  # fmt: skip
    trainer.train()
    spans.sort()
    overlapping = sum(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))
    assert len(spans) >= 4 and overlapping >= 1, spans


def test_a_hanging_tool_times_out_as_a_failed_call_and_training_goes_on(tmp_path, tool_model_dir):
    release = threading.Event()

    @as_multiply
    def multiply(a: int, b: int) -> int:
        release.wait(60)  # hangs (until the test ends)
        return a * b

    def ours():  # started by this test's trainer (another test's leftovers are not this test's to judge)
        return [t for t in threading.enumerate()
                if t.name.startswith(("trl_async-tools", "trl_async-episodes")) and t.ident not in before]  # fmt: skip

    before = {t.ident for t in threading.enumerate()}
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                               # room for the error message (a longer tool result would be rolled back, as GRPOTrainer does)
                               args=async_args(tmp_path, **{**TOOL_SETTINGS, "max_completion_length": 128},
                                               rollout_tool_timeout_s=0.5, max_staleness=0),
                               train_dataset=dataset(["What is 3 times 4?", "Say hello.", "What is 8 over 2?"]),
                               tools=[multiply])  # fmt: skip
    try:
        trainer.train()
    finally:
        release.set()
    assert trainer.state.global_step == TOOL_SETTINGS["max_steps"]
    results = [m["content"] for _, cs in recorder.seen for c in cs for m in c if m["role"] == "tool"]
    assert "{'error': 'tool multiply did not return within 0.5 s (rollout_tool_timeout_s)'}" in results
    calls = sum(f for f, _ in tool_metrics(trainer))
    assert calls > 0 and all(failure == 1.0 for _, failure in tool_metrics(trainer))  # every call failed
    assert no_rollout_children()
    deadline = time.monotonic() + 10  # the hung tool's thread returns once released (above), a moment later
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours()


def test_a_tool_result_that_would_overflow_is_rolled_back_as_grpo_trainer_does(tmp_path, tool_model_dir):
    @as_multiply
    def multiply(a: int, b: int) -> int:
        return "9" * 200  # a result longer than what is left of max_completion_length

    prompts = ["What is 3 times 4?", "Say hello."]
    settings = {**TOOL_SETTINGS, "per_device_train_batch_size": 4, "max_steps": 1}
    tokenizer = tokenizer_of(tool_model_dir)
    sync = KeepingGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer,
                              args=GRPOConfig(output_dir=str(tmp_path / "sync"), **settings),
                              train_dataset=dataset(prompts), tools=[multiply])  # fmt: skip
    sync.train()
    recorder = Recorder()
    ours = KeepingAsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer,
                                   args=async_args(tmp_path / "async", **settings, max_staleness=0),
                                   train_dataset=dataset(prompts), tools=[multiply])  # fmt: skip
    ours.train()
    assert sorted(ours.loop_outputs) == sorted(sync.loop_outputs)
    ids, mask = next((i, m) for p, i, m in ours.loop_outputs if p == "What is 3 times 4?")
    assert all(mask) and tokenizer.decode(ids).endswith("</tool_call><|im_end|>")  # ends on the call, no result
    messages = next(
        c for ps, cs in recorder.seen for p, c in zip(ps, cs, strict=True) if "3 times" in p[-1]["content"]
    )
    assert [m["role"] for m in messages] == ["assistant"]  # the rolled-back tool message is gone
    assert tool_metrics(ours) == tool_metrics(sync) == [(0.5, 0.0)]  # the call still counts, as in GRPOTrainer


class VersionedTrainer(AsyncGRPOTrainer):
    """Keeps the weights of every published version and every consumed episode."""

    def _publish_weights(self, version):
        model = self.accelerator.unwrap_model(self.model)
        self.snapshots = getattr(self, "snapshots", {})
        self.snapshots[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return super()._publish_weights(version)

    def _tool_call_loop(self, *args, **kwargs):
        self.episodes = getattr(self, "episodes", [])
        for g, j in self._consuming:
            group = g.group
            self.episodes.append((list(group.prompt_ids), list(group.completion_ids[j]), list(group.logprobs[j]),
                                  list(group.versions[j]), list(group.tool_mask[j])))  # fmt: skip
        return super()._tool_call_loop(*args, **kwargs)


def test_an_episode_spanning_a_weight_sync_is_corrected_token_by_token(tmp_path, tool_model_dir):
    """While an episode waits for its (slow) tool, the trainer trains on other groups and publishes new weights, so
    the episode's next turn is sampled from a newer version. Every sampled token carries its own version, and its mu
    equals a teacher-forced forward of the weights of that version; tool-result tokens are masked, with a 0.0
    placeholder and the version of the token before them."""
    import torch
    from transformers import AutoModelForCausalLM

    @as_multiply
    def multiply(a: int, b: int) -> int:
        time.sleep(0.3)
        return a * b

    temperature = 0.7
    settings = {**TOOL_SETTINGS, "temperature": temperature, "learning_rate": 3e-3, "max_steps": 5,
                "per_device_train_batch_size": 4}  # fmt: skip
    trainer = VersionedTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                               # staleness room for episodes that wait for their tool while several steps train
                               args=async_args(tmp_path, **settings, max_staleness=8,
                                               rollout_trajectory_file="trajectories.jsonl"),
                               # only tool-calling prompts: the fast (failing) calls cannot fill every batch
                               train_dataset=dataset(["What is 3 times 4?", "What is 8 over 2?"]),
                               tools=[multiply])  # fmt: skip
    trainer.train()
    spanning = [e for e in trainer.episodes if len({v for v, m in zip(e[3], e[4], strict=True) if m}) > 1]
    assert spanning, [sorted(set(e[3])) for e in trainer.episodes]
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    checked = 0
    for prompt, completion, logprobs, versions, mask in trainer.episodes:
        assert len(completion) == len(logprobs) == len(versions) == len(mask)
        ids = torch.tensor([prompt + completion])
        for t, masked in enumerate(mask):
            if not masked:  # a tool-result token: no mu, the version of the sampled token before it
                assert logprobs[t] == 0.0 and t > 0 and versions[t] == versions[t - 1]
        for version in sorted(set(versions)):
            model.load_state_dict(trainer.snapshots[version])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            for t in range(len(completion)):
                if mask[t] and versions[t] == version:
                    assert abs(logprobs[t] - float(expected[t])) < 1e-4, (version, t)
                    checked += 1
    assert checked > 50
    # the audit trail records each turn: its versions, and the tool calls with their results
    import json

    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    called = [r for r in records if "3 times 4" in r["prompt"][-1]["content"] and len(r["turns"]) == 2]
    assert called and all(sum(r["tool_mask"]) < len(r["tool_mask"]) for r in called)
    for r in called:
        assert r["turns"][0]["tool_calls"] == [{"name": "multiply", "arguments": {"a": 3, "b": 4}, "result": "12",
                                                "failed": False}]  # fmt: skip
        assert sorted({v for t in r["turns"] for v in t["versions"]}) == sorted(set(r["versions"]))
    assert any(r["turns"][0]["versions"] != r["turns"][1]["versions"] for r in called)


def test_tools_with_plain_text_prompts_fail_at_construction(tmp_path, tool_model_dir):
    with pytest.raises(ValueError, match="`tools` need conversational prompts"):
        AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                         args=async_args(tmp_path, **TOOL_SETTINGS),
                         train_dataset=Dataset.from_list([{"prompt": "What is 3 times 4?"}] * 3), tools=[multiply])  # fmt: skip


def test_a_sandboxed_python_tool_answers_in_multi_turn_training(tmp_path, tool_model_dir):
    """The model's tool call runs as a program in the sandbox (the ``python`` tool), and what it printed comes back
    as the tool message, with TRL's call and failure counts."""
    from trl_async.sandbox.rewards import python_tool

    python = python_tool()

    @as_multiply
    def sandboxed_multiply(a: int, b: int) -> int:
        return python(f"print({a!r} * {b!r}, end='')")

    recorder = Recorder()
    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                               args=async_args(tmp_path, **TOOL_SETTINGS, max_staleness=0),
                               train_dataset=dataset(TRL_PROMPTS), tools=[sandboxed_multiply])  # fmt: skip
    trainer.train()
    assert tool_metrics(trainer) == [(pytest.approx(2 / 3), 0.5)] * 2
    by_prompt = {p[-1]["content"]: c for ps, cs in recorder.seen for p, c in zip(ps, cs, strict=True)}
    assert by_prompt["What is 3 times 4?"][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert no_rollout_children()
