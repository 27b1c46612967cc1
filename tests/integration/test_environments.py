"""`environment_factory`: one environment instance per episode, `reset` per episode, its methods as tools,
environment-owned rewards, several environments selected by the dataset, checked against TRL's GRPOTrainer on the
same tiny tool-calling model (tests/tool_model.py)."""

from __future__ import annotations

import threading
import time

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, no_rollout_children
from ..tool_model import as_multiply, conversation
from .test_tools import TOOL_SETTINGS, Recorder, tokenizer_of, tool_metrics

PROMPTS = ["What is 3 times 4?", "What is 5 times 6?", "Say hello."]


class Multiplier:
    """Its `multiply` renders like tests/tool_model.multiply (the model was fitted on that schema)."""

    created = 0
    overlaps = 0  # an instance reset for a second episode before the first one's reward
    lock = threading.Lock()

    def __init__(self):
        with Multiplier.lock:
            type(self).created += 1
        self.busy = False

    def reset(self, answer, **kwargs):
        with Multiplier.lock:
            Multiplier.overlaps += self.busy
        self.busy = True
        self.answer, self.result = answer, None
        return None

    @as_multiply
    def multiply(self, a: int, b: int) -> int:
        self.result = self._compute(a, b)
        return self.result

    def _compute(self, a: int, b: int) -> int:  # private: not a tool
        return a * b

    def get_reward(self) -> float:
        self.busy = False
        return float(self.result == self.answer)


def rows(environment=None):
    answers = {"What is 3 times 4?": 12, "What is 5 times 6?": 30, "Say hello.": 0}
    out = [{"prompt": conversation(p), "answer": answers[p]} for p in PROMPTS]
    return Dataset.from_list([{**r, "environment": environment(i)} for i, r in enumerate(out)] if environment else out)


def test_environment_owned_rewards_and_messages_match_grpo_trainer(tmp_path, tool_model_dir):
    reference = Recorder()
    sync = GRPOTrainer(model=tool_model_dir, reward_funcs=reference, processing_class=tokenizer_of(tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **TOOL_SETTINGS),
                       train_dataset=rows(), environment_factory=Multiplier)  # fmt: skip
    sync.train()
    Multiplier.created = Multiplier.overlaps = 0
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path / "async", **TOOL_SETTINGS, max_staleness=0),
                            train_dataset=rows(), environment_factory=Multiplier)  # fmt: skip
    ours.train()
    assert tool_metrics(ours) == tool_metrics(sync) == [(pytest.approx(2 / 3), 0.5)] * 2

    def env_rewards(t):
        return [h["rewards/Multiplier/mean"] for h in t.state.log_history if "rewards/Multiplier/mean" in h]

    # the environment owns a reward: 3 x 4 = 12 is right (1), the failed call and plain text are not (0)
    assert env_rewards(ours) == env_rewards(sync) == [pytest.approx(1 / 3)] * 2
    by_prompt = lambda seen: {p[-1]["content"]: c for ps, cs in seen for p, c in zip(ps, cs, strict=True)}  # noqa: E731
    assert by_prompt(recorder.seen) == by_prompt(reference.seen)
    # one instance per episode at a time, reused across episodes (4 steps' worth of episodes, fewer instances)
    assert 0 < Multiplier.created < 2 * 6 and Multiplier.overlaps == 0
    assert no_rollout_children()


class Adder(Multiplier):
    def _compute(self, a: int, b: int) -> int:
        return a * b + 1


def test_several_environments_selected_by_the_dataset(tmp_path, tool_model_dir):
    factories = {"mul": Multiplier, "add": Adder}
    data = rows(environment=lambda i: ["mul", "add", "mul"][i])
    reference = Recorder()
    sync = GRPOTrainer(model=tool_model_dir, reward_funcs=reference, processing_class=tokenizer_of(tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **TOOL_SETTINGS),
                       train_dataset=data, environment_factory=factories)  # fmt: skip
    sync.train()
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path / "async", **TOOL_SETTINGS, max_staleness=0),
                            train_dataset=data, environment_factory=factories)  # fmt: skip
    ours.train()
    by_prompt = lambda seen: {p[-1]["content"]: c for ps, cs in seen for p, c in zip(ps, cs, strict=True)}  # noqa: E731
    ours_seen = by_prompt(recorder.seen)
    assert ours_seen == by_prompt(reference.seen)
    assert ours_seen["What is 3 times 4?"][1]["content"] == "12"  # Multiplier's tool
    logs = [{k: v for k, v in h.items() if k.startswith("rewards/")} for h in ours.state.log_history if "loss" in h]
    theirs = [{k: v for k, v in h.items() if k.startswith("rewards/")} for h in sync.state.log_history if "loss" in h]
    assert logs == theirs


class Observing(Multiplier):
    def reset(self, answer, **kwargs):
        super().reset(answer)
        return " Use the tool."


def test_reset_observation_is_appended_to_the_prompt(tmp_path, tool_model_dir):
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path, **{**TOOL_SETTINGS, "max_steps": 1}),
                            train_dataset=rows(), environment_factory=Observing)  # fmt: skip
    ours.train()
    seen = {p[-1]["content"] for ps, _ in recorder.seen for p in ps}
    assert seen == {p + " Use the tool." for p in PROMPTS}


class Fragile(Multiplier):
    def reset(self, answer, **kwargs):
        if answer == 30:
            raise RuntimeError("cannot set up this task")
        return super().reset(answer)


def test_a_raising_reset_skips_its_group_and_training_goes_on(tmp_path, tool_model_dir):
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path, **{**TOOL_SETTINGS, "per_device_train_batch_size": 4}),
                            train_dataset=rows(), environment_factory=Fragile)  # fmt: skip
    ours.train()
    assert ours.state.global_step == TOOL_SETTINGS["max_steps"]
    assert ours.last_rollout_pool.abandoned_groups >= 1
    assert "What is 5 times 6?" not in {p[-1]["content"] for ps, _ in recorder.seen for p in ps}
    assert no_rollout_children()


class Judge:
    """An environment with no tools: it only owns the reward (single-turn episodes)."""

    def reset(self, answer, **kwargs):
        self.answer = answer

    def get_reward(self) -> float:
        return float(self.answer == 12)


def test_an_environment_without_tools_trains_like_grpo_trainer(tmp_path, tool_model_dir):
    settings = {**TOOL_SETTINGS, "max_steps": 1}
    sync = GRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **settings),
                       train_dataset=rows(), environment_factory=Judge)  # fmt: skip
    reference = sync.reward_funcs[0]
    sync.train()
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path / "async", **settings, max_staleness=0),
                            train_dataset=rows(), environment_factory=Judge)  # fmt: skip
    ours.train()
    judged = lambda t: [h["rewards/Judge/mean"] for h in t.state.log_history if "rewards/Judge/mean" in h]  # noqa: E731
    assert judged(ours) == judged(sync) == [pytest.approx(1 / 3)]
    # no tools: no response parser either; completions are the decoded text, as GRPOTrainer gives them
    by_prompt = lambda seen: {p[-1]["content"]: c for ps, cs in seen for p, c in zip(ps, cs, strict=True)}  # noqa: E731
    assert by_prompt(recorder.seen) == by_prompt(reference.seen) and set(by_prompt(recorder.seen)) == set(PROMPTS)


def test_evaluation_between_steps_leaves_training_environments_alone(tmp_path, tool_model_dir):
    """GRPOTrainer's evaluation resets its own environment instances; the next training batch must not see them."""
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path, **TOOL_SETTINGS, eval_strategy="steps", eval_steps=1,
                                            per_device_eval_batch_size=6),
                            train_dataset=rows(), eval_dataset=rows(), environment_factory=Multiplier)  # fmt: skip
    ours.train()
    assert ours.state.global_step == TOOL_SETTINGS["max_steps"]
    assert [h for h in ours.state.log_history if "eval_loss" in h or "eval_reward" in h]


class Broken(Multiplier):
    def reset(self, answer, **kwargs):
        raise RuntimeError("the sandbox is down")


def test_a_reset_that_always_raises_stops_training_with_its_error(tmp_path, tool_model_dir):
    ours = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=Recorder(), processing_class=tokenizer_of(tool_model_dir),
                            args=async_args(tmp_path, **TOOL_SETTINGS), train_dataset=rows(),
                            environment_factory=Broken)  # fmt: skip
    with pytest.raises(
        RuntimeError, match="groups in a row could not run(.|\\n)*reset raised(.|\\n)*the sandbox is down"
    ):
        ours.train()
    assert no_rollout_children()


class SlowMultiplier:
    """Every call outlasts the tool timeout (0.5 s in the tests) by ``seconds``; records how many of its calls ever ran
    at once, and when the last one returned."""

    instances: list = []
    lock = threading.Lock()
    seconds = 0.8

    def __init__(self):
        self.inside, self.most_inside, self.entered, self.returned_at = 0, 0, 0, None
        with SlowMultiplier.lock:
            SlowMultiplier.instances.append(self)

    def reset(self, **kwargs):
        return None

    @as_multiply
    def multiply(self, a: int, b: int) -> int:
        with SlowMultiplier.lock:
            self.inside, self.entered = self.inside + 1, self.entered + 1
            self.most_inside = max(self.most_inside, self.inside)
        time.sleep(self.seconds)
        with SlowMultiplier.lock:
            self.inside -= 1
            self.returned_at = time.monotonic()
        return a * b


class StuckMultiplier(SlowMultiplier):
    seconds = 30.0  # still running another timeout later


TIMED_OUT = "{'error': 'tool multiply did not return within 0.5 s (rollout_tool_timeout_s)'}"


@pytest.fixture(scope="module", params=["across_turns", "within_a_turn"])
def timeout_model_dir(request, tmp_path_factory) -> str:
    """across_turns: calls multiply, and after the result (or the timeout's error) calls it again, then says "Done!";
    within_a_turn: calls multiply twice in its first turn (two parallel calls), then says "Done!"."""
    from trl_async.demo import tiny
    from trl_async.rollout.episodes import ENVIRONMENT_BUSY

    from ..tool_model import FIRST_TURNS, multiply

    call = FIRST_TURNS["What is 3 times 4?"]
    busy = str({"error": ENVIRONMENT_BUSY})
    episodes = {
        "across_turns": [(call, [TIMED_OUT, "12"]), (call, [busy, "12"]), ("Done!", [])],
        "within_a_turn": [(call + "\n" + call, [TIMED_OUT, busy, "12"]), ("Done!", [])],
    }[request.param]
    return str(
        tiny.build_tool_model(tmp_path_factory.mktemp(request.param), {"What is 3 times 4?": episodes}, [multiply])
    )


def test_after_a_timed_out_call_an_environment_episode_runs_no_more_calls_on_its_instance(tmp_path, timeout_model_dir):
    """The timed-out call is still running on the episode's environment instance: a later call of the episode, in
    the same turn or a later one, would run beside it on the same state. It is not run; the model reads why; the
    instance is not reused."""
    from trl_async.rollout.episodes import ENVIRONMENT_BUSY

    SlowMultiplier.instances = []
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(
        model=timeout_model_dir, reward_funcs=recorder, processing_class=tokenizer_of(timeout_model_dir),
        args=async_args(tmp_path, **{**TOOL_SETTINGS, "per_device_train_batch_size": 2, "max_completion_length": 160},
                        rollout_tool_timeout_s=0.5, max_staleness=0),
        train_dataset=Dataset.from_list([{"prompt": conversation("What is 3 times 4?")}] * 4),
        environment_factory=SlowMultiplier,
    )  # fmt: skip
    trainer.train()
    tool_messages = [[m["content"] for m in c if m["role"] == "tool"] for _, cs in recorder.seen for c in cs]
    assert tool_messages and all(m and m[0] == TIMED_OUT for m in tool_messages), tool_messages
    later = [m[1] for m in tool_messages if len(m) > 1]
    assert later and all(m == str({"error": ENVIRONMENT_BUSY}) for m in later), tool_messages
    # each instance served one episode (not reused) and ran one call (episodes generated for a step that never came
    # also count: at least as many instances as episodes rewarded)
    used = [e for e in SlowMultiplier.instances if e.entered]
    assert len(used) >= len(tool_messages) and all(e.entered == 1 for e in used)
    # the calls not run count as failed calls, as GRPOTrainer counts any failed call
    assert all(failure == 1.0 for _, failure in tool_metrics(trainer))


def test_an_environment_is_scored_only_after_its_timed_out_call_returned(tmp_path, timeout_model_dir):
    """A timed-out call keeps running on the episode's instance; the episode ends meanwhile. Its rewards read the
    instance only once that call has returned, so no reward reads a state a call is still changing."""
    SlowMultiplier.instances = []
    reads = []

    def settled_reward(completions, environments, **kwargs):
        now = time.monotonic()
        reads.extend((env.inside, env.returned_at, now) for env in environments)
        return [0.0] * len(completions)

    trainer = AsyncGRPOTrainer(
        model=timeout_model_dir, reward_funcs=settled_reward, processing_class=tokenizer_of(timeout_model_dir),
        args=async_args(tmp_path, **{**TOOL_SETTINGS, "per_device_train_batch_size": 2, "max_completion_length": 160},
                        rollout_tool_timeout_s=0.5, max_staleness=0),
        train_dataset=Dataset.from_list([{"prompt": conversation("What is 3 times 4?")}] * 4),
        environment_factory=SlowMultiplier,
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and reads
    assert all(inside == 0 and returned is not None and returned <= read for inside, returned, read in reads), reads


def test_an_environment_whose_timed_out_call_never_returns_is_not_scored(tmp_path, timeout_model_dir):
    """Still running another timeout later: the instance's state is unknowable, so the group is abandoned (never
    scored); when every group is, training stops and says why."""
    SlowMultiplier.instances = []
    scored = []
    trainer = AsyncGRPOTrainer(
        model=timeout_model_dir, reward_funcs=lambda completions, **kw: scored.append(1) or [0.0] * len(completions),
        processing_class=tokenizer_of(timeout_model_dir),
        args=async_args(tmp_path, **{**TOOL_SETTINGS, "per_device_train_batch_size": 2, "max_completion_length": 160},
                        rollout_tool_timeout_s=0.5, max_staleness=0),
        train_dataset=Dataset.from_list([{"prompt": conversation("What is 3 times 4?")}] * 4),
        environment_factory=StuckMultiplier,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="could not run(.|\\n)*timed out(.|\\n)*still running"):
        trainer.train()
    assert not scored
