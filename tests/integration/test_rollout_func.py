"""``rollout_func``: the user's rollout runs in the background per group (trl_async/rollout/rollout_func.py). The pure
pieces by hand, then real training with real rollout workers: single- and multi-turn rollouts, versions, env_mask,
extra fields, errors, evaluation."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from trl_async import AsyncGRPOTrainer
from trl_async.records import RolloutGroup, RolloutTask
from trl_async.rollout.rollout_func import _Call, build_group, replayed_output
from trl_async.rollout.scoring import with_extra_fields

from ..conftest import async_args, no_rollout_children, text_dataset

TASK = RolloutTask(group_id=3, prompt_index=7, prompt_ids=(), admitted_at_version=2)


def _output(**overrides):
    out = {
        "prompt_ids": [[1, 2], [1, 2]],
        "completion_ids": [[5, 6, 7], [8]],
        "logprobs": [[-0.1, -0.2, -0.3], [-1.0]],
    }
    return {**out, **overrides}


def _call(sampled=None, oldest=None):
    call = _Call(TASK)
    call.sampled, call.oldest = dict(sampled or {}), oldest
    return call


# ---- the output's validation and versions, by hand ------------------------------------------------------------------
@pytest.mark.unit
def test_a_returned_completion_that_was_sampled_keeps_its_own_versions_an_edited_one_the_oldest():
    call = _call({(5, 6, 7): (4, 4, 5), (8, 9): (5, 5)}, oldest=4)
    group = build_group(TASK, _output(), call, num_generations=2)
    # (8,) was not sampled as such (the rollout cut it): every token gets the oldest version of this call, 4
    assert group.versions == ((4, 4, 5), (4,))
    assert group.completion_ids == ((5, 6, 7), (8,)) and group.row_prompt_ids == ((1, 2), (1, 2))
    assert (group.group_id, group.prompt_index, group.prompt_ids) == (3, 7, (1, 2))
    assert group.logprobs == ((-0.1, -0.2, -0.3), (-1.0,)) and group.extra_fields == {} and group.tool_mask == ()


@pytest.mark.unit
def test_the_same_completion_sampled_twice_keeps_the_older_version_of_each_token():
    call = _Call(TASK)
    call.record([[5, 6, 7], [8]], [[3, 3, 4], [3]])
    call.record([[5, 6, 7]], [[5, 2, 5]])  # sampled again later (and a planted older token in the middle)
    group = build_group(TASK, _output(), call, num_generations=2)
    assert group.versions == ((3, 2, 4), (3,)) and call.oldest == 2


@pytest.mark.unit
def test_a_reported_version_newer_than_the_trainer_or_empty_completions_are_refused():
    with pytest.raises(ValueError, match="policy_version 9, but the trainer is at version 4"):
        build_group(TASK, _output(policy_version=9), _call(), 2, newest_version=4)
    with pytest.raises(ValueError, match="only empty completions"):
        build_group(TASK, _output(completion_ids=[[], []], logprobs=[[], []]), _call(oldest=0), 2)
    import numpy as np

    assert build_group(TASK, _output(policy_version=np.int64(3)), _call(), 2, newest_version=4).versions[1] == (3,)


@pytest.mark.unit
def test_the_runner_delivers_each_turn_to_its_rollout_and_closing_ends_a_waiting_one():
    """Without workers: ``submit_turn`` answers some turns at once (as the collector would, by key) and holds the
    others; the answered rollout finishes with its tokens' versions, the held one ends silently at close."""
    import functools
    from types import SimpleNamespace

    from trl_async.rollout.rollout_func import RolloutFuncRunner
    from trl_async.setup.trainer_view import RolloutFuncTrainerView

    submitted, finished, failed, hold = [], [], [], threading.Event()

    def submit_turn(turn):
        submitted.append(turn)
        if turn.prompt_index == 0:  # answer: one completion per context, of version 7
            group = RolloutGroup(turn.group_id, 0, turn.prompt_ids, tuple((len(c),) for c in turn.contexts),
                                 tuple((-0.5,) for _ in turn.contexts), tuple((7,) for _ in turn.contexts), 0, 0.0,
                                 rows=turn.rows)  # fmt: skip
            threading.Thread(target=runner.on_turn, args=(group, 0)).start()

    def rollout(prompts, trainer):
        ids = [[1, 2]] * len(prompts)
        out = trainer.rollout_generate(ids, max_new_tokens=1)
        hold.set()
        return {"prompt_ids": ids, "completion_ids": out["completion_ids"], "logprobs": out["logprobs"]}

    view = functools.partial(RolloutFuncTrainerView, SimpleNamespace(state=SimpleNamespace(global_step=7)))
    runner = RolloutFuncRunner(rollout_func=rollout, trainer_view=view, version=lambda: 7, tokenizer=object(),
                               row=lambda group_id: {"prompt": "a"}, num_generations=2, timeout_s=30, max_model_len=None, max_new_tokens=4,
                               submit_turn=submit_turn, finished=finished.append, fail=failed.append)  # fmt: skip
    runner.start(RolloutTask(0, 0, (), 7))
    assert hold.wait(10)
    runner.start(RolloutTask(1, 1, (), 7))  # its turn is never answered
    deadline = time.monotonic() + 10
    while not finished or len(submitted) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [(t.group_id, t.rows, t.contexts, t.max_new_tokens) for t in submitted] == [
        (0, (0, 1), ((1, 2), (1, 2)), 1), (1, (0, 1), ((1, 2), (1, 2)), 1)]  # fmt: skip
    assert finished[0].completion_ids == ((2,), (2,)) and finished[0].versions == ((7,), (7,))
    runner.close()
    time.sleep(0.2)
    assert len(finished) == 1 and not failed  # the held rollout ended at close, reporting nothing
    assert not [t for t in threading.enumerate() if t.name.startswith("trl_async-rollout")]


@pytest.mark.unit
def test_policy_version_reported_by_the_rollout_wins_and_is_not_forwarded_to_rewards():
    group = build_group(TASK, _output(policy_version=9, source=["a", "b"]), _call(), num_generations=2)
    assert group.versions == ((9, 9, 9), (9,)) and group.extra_fields == {"source": ["a", "b"]}
    per_token = build_group(TASK, _output(policy_version=[[1, 2, 3], [4]]), _call(), num_generations=2)
    assert per_token.versions == ((1, 2, 3), (4,))


@pytest.mark.unit
def test_bad_outputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"must return keys \['logprobs'\]"):
        build_group(TASK, {"prompt_ids": [[1]] * 2, "completion_ids": [[2]] * 2}, _call(oldest=0), 2)
    with pytest.raises(ValueError, match="returned 1 entries for 'completion_ids'.*repeated 2 times"):
        build_group(TASK, _output(completion_ids=[[5]]), _call(oldest=0), 2)
    with pytest.raises(ValueError, match="logprobs=None"):
        build_group(TASK, _output(logprobs=None), _call(oldest=0), 2)
    with pytest.raises(ValueError, match="completion 1 has 1 tokens but 2 logprobs"):
        build_group(TASK, _output(logprobs=[[0.0] * 3, [0.0, 0.0]]), _call(oldest=0), 2)
    with pytest.raises(ValueError, match="an env_mask of 2"):
        build_group(TASK, _output(env_mask=[[1, 1, 1], [1, 0]]), _call(oldest=0), 2)
    # nothing sampled through rollout_generate and no version reported: refused, not trained as fresh
    with pytest.raises(ValueError, match="returned no 'policy_version'"):
        build_group(TASK, _output(), _call(), 2)


@pytest.mark.unit
def test_extra_fields_are_merged_as_grpo_trainer_merges_them():
    extras = {"a": [10, 11], "b": "same", "short": [1]}
    assert with_extra_fields({"prompt": "p"}, 0, extras) == {"prompt": "p", "a": 10, "b": "same", "short": 1}
    assert with_extra_fields({"prompt": "p"}, 1, extras) == {"prompt": "p", "a": 11, "b": "same"}  # no "short"


@pytest.mark.unit
def test_replayed_output_is_the_rollouts_output_for_the_consumed_rows():
    group = build_group(TASK, _output(env_mask=[[1, 0, 1], [1]], hint=["x", "y"]), _call(oldest=0), 2)
    plain = RolloutGroup(4, 1, (9,), ((3,),), ((-0.5,),), ((0,),), 0, 0.0, row_prompt_ids=((9,),))
    out = replayed_output([(group, 1), (plain, 0), (group, 0)])
    assert out["prompt_ids"] == [[1, 2], [9], [1, 2]]
    assert out["completion_ids"] == [[8], [3], [5, 6, 7]]
    assert out["env_mask"] == [[1], [1], [1, 0, 1]]  # a group without a mask: all model tokens
    assert out["logprobs"] == [[-1.0], [-0.5], [-0.1, -0.2, -0.3]]
    # extra fields already reached the rewards in the background, per group; GRPOTrainer needs them for nothing else
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}


# ---- real training ---------------------------------------------------------------------------------------------------
class SingleTurn:
    """Renders the prompt itself (as rollout_func must), samples with the workers, adds an extra field."""

    def __init__(self):
        self.calls: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, prompts, trainer):
        tokenizer = trainer.processing_class
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        out = trainer.rollout_generate(ids)
        with self.lock:
            self.calls.append(dict(thread=threading.current_thread().name, prompts=prompts, tokenizer=tokenizer,
                                   completion_ids=out["completion_ids"], versions=out["versions"]))  # fmt: skip
        return {"prompt_ids": ids, "completion_ids": out["completion_ids"], "logprobs": out["logprobs"],
                "origin": [f"{p}#{i}" for i, p in enumerate(prompts)]}  # fmt: skip


def _origin_reward(seen):
    def origin_reward(prompts, completions, origin, **kwargs):
        seen.append((list(prompts), list(origin)))
        return [float(len(c)) / 10 for c in completions]

    return origin_reward


def test_a_single_turn_rollout_func_trains_on_what_it_returned_with_the_workers_versions(tmp_path, tiny_model_dir):
    rollout, seen = SingleTurn(), []
    args = async_args(tmp_path, max_steps=3, rollout_trajectory_file="traj.jsonl", max_staleness=1)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=_origin_reward(seen), args=args,
                               train_dataset=text_dataset(), rollout_func=rollout)  # fmt: skip
    trainer.train()
    assert no_rollout_children()
    # it ran in the background, per group (the prompt repeated num_generations=4 times), with its own tokenizer
    assert all(c["thread"].startswith("trl_async-rollout") for c in rollout.calls)
    assert all(len(c["prompts"]) == 4 and len(set(c["prompts"])) == 1 for c in rollout.calls)
    assert all(c["tokenizer"] is not trainer.processing_class for c in rollout.calls)
    # rewards got the extra field of each completion, in order
    for prompts, origin in seen:
        assert origin == [f"{p}#{i}" for i, p in enumerate(prompts)]
    # what was trained on is exactly what the rollout returned, with the versions the workers sampled with
    returned = {tuple(map(tuple, c["completion_ids"])): c["versions"] for c in rollout.calls}
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 8
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    for group in by_group.values():
        key = tuple(tuple(r["completion_ids"]) for r in group)
        assert [r["versions"] for r in group] == returned[key]
        assert all(r["staleness"] == r["step"] - min(min(v) for v in returned[key]) <= 1 for r in group)
    assert any(r["staleness"] == 1 for r in rows)  # it did run ahead of the trainer


class MultiTurn:
    """Two turns: the first samples 2 tokens per row; the 'environment' appends 3 fixed tokens; the second turn
    continues each row's own context. env_mask marks the environment's tokens."""

    ENV = [7, 8, 9]

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, prompts, trainer):
        ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        first = trainer.rollout_generate(ids, max_new_tokens=2)
        self.between_turns(trainer)
        contexts = [p + c + self.ENV for p, c in zip(ids, first["completion_ids"], strict=True)]
        second = trainer.rollout_generate(contexts, max_new_tokens=3)
        completions, logprobs, masks = [], [], []
        for i in range(len(prompts)):
            a, b = first["completion_ids"][i], second["completion_ids"][i]
            completions.append(a + self.ENV + b)
            logprobs.append(first["logprobs"][i] + [0.0] * 3 + second["logprobs"][i])
            masks.append([1] * len(a) + [0] * 3 + [1] * len(b))
        with self.lock:
            self.calls.append((first, second))
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": logprobs, "env_mask": masks}

    def between_turns(self, trainer):
        pass


class SpanningTurns(MultiTurn):
    """The first two rollouts to start run straight through (they make step 0's batch); the next two wait between
    their turns until version 1 (step 0's weights) is published, so their second turn samples with newer weights
    than their first (and are the only ones step 1 can take: later rollouts wait for version 2). ``trainer`` is set
    by the test: the waits read its pool's published version (the step count moves on before the publish)."""

    def __init__(self):
        super().__init__()
        self.started = 0
        self.trainer = None

    def between_turns(self, trainer):
        with self.lock:
            k, self.started = self.started, self.started + 1
        deadline = time.monotonic() + 60
        target = 1 if k < 4 else 2
        while k >= 2 and time.monotonic() < deadline:
            pool = self.trainer.rollout_pool
            if pool is None or (pool.published_version or 0) >= target:  # None: training has ended
                return
            time.sleep(0.02)


class MaskRecorder(AsyncGRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.masks = getattr(self, "masks", []) + [inputs["tool_mask"].clone()]
        return super()._compute_loss(model, inputs)


def test_a_multi_turn_rollout_func_masks_its_environment_tokens_and_bounds_their_versions(tmp_path, tiny_model_dir):
    rollout = SpanningTurns()
    args = async_args(tmp_path, max_steps=2, rollout_trajectory_file="traj.jsonl", max_completion_length=16)
    trainer = MaskRecorder(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                           args=args, train_dataset=text_dataset(), rollout_func=rollout)  # fmt: skip
    rollout.trainer = trainer
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    calls = {}
    for first, second in rollout.calls:
        for i in range(4):
            a, b = first["completion_ids"][i], second["completion_ids"][i]
            calls[tuple(a + MultiTurn.ENV + b)] = (first, second, i)
    for r in rows:
        first, second, i = calls[tuple(r["completion_ids"])]
        n_a, n_b = len(first["completion_ids"][i]), len(second["completion_ids"][i])
        assert r["tool_mask"] == [1] * n_a + [0] * 3 + [1] * n_b
        # an assembled completion: every token gets the oldest version this rollout sampled with
        oldest = min(v for turn in (first, second) for row in turn["versions"] for v in row)
        assert r["versions"] == [oldest] * (n_a + 3 + n_b)
        assert n_a <= 2 and n_b <= 3
    # step 1 trained on rollouts whose turns spanned a weight sync: their tokens all carry the older version
    spanning = [r for r in rows if r["step"] == 1]
    for r in spanning:
        first, second, _ = calls[tuple(r["completion_ids"])]
        assert {v for row in first["versions"] for v in row} == {0} and {
            v for row in second["versions"] for v in row
        } == {1}
        assert set(r["versions"]) == {0} and r["staleness"] == 1
    assert len(spanning) == 8
    # the loss saw the environment's tokens masked out
    for mask in trainer.masks:
        assert (mask == 0).sum() > 0
    masked = torch.cat([m.flatten() for m in trainer.masks])
    assert int((masked == 0).sum()) == 3 * len(rows)  # the environment's 3 per row (padding is masked elsewhere)


def test_a_raising_rollout_func_stops_training_with_its_error(tmp_path, tiny_model_dir):
    def broken(prompts, trainer):
        raise KeyError("no such field in my environment")

    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=async_args(tmp_path, max_steps=2), train_dataset=text_dataset(),
                               rollout_func=broken)  # fmt: skip
    with pytest.raises(KeyError, match="no such field") as excinfo:
        trainer.train()
    assert any("rollout_func, train_dataset row" in note for note in excinfo.value.__notes__)
    assert no_rollout_children()


def test_a_rollout_that_samples_elsewhere_without_a_version_is_refused(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def own_engine(prompts, trainer):
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[5, 6]] * len(ids), "logprobs": [[-1.0, -1.0]] * len(ids)}

    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=async_args(tmp_path, max_steps=1), train_dataset=text_dataset(),
                               rollout_func=own_engine)  # fmt: skip
    with pytest.raises(ValueError, match="policy_version"):
        trainer.train()


def test_a_rollout_that_reports_a_stale_version_is_dropped_and_counted(tmp_path, tiny_model_dir):
    """policy_version is believed: an own-engine rollout that says its weights are version -3 is too stale for
    max_staleness=1 at the first step, dropped before scoring, and its prompt generated again, then trained on."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reports = iter([-3] + [None] * 1000)

    def own_engine(prompts, trainer):
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        version = next(reports)
        return {"prompt_ids": ids, "completion_ids": [[5, 6]] * len(ids), "logprobs": [[-1.0, -1.0]] * len(ids),
                "policy_version": trainer.state.global_step if version is None else version}  # fmt: skip

    args = async_args(tmp_path, max_steps=1, max_staleness=1, rollout_queue_size=2)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, train_dataset=text_dataset(), rollout_func=own_engine)  # fmt: skip
    trainer.train()
    assert trainer.last_rollout_pool.dropped_groups == 1 and trainer.last_rollout_pool.dropped_samples == 4


def test_evaluation_runs_the_rollout_func_on_the_main_thread_with_the_trainers_model(tmp_path, tiny_model_dir):
    rollout = SingleTurn()
    args = async_args(tmp_path, max_steps=1, per_device_eval_batch_size=8, eval_strategy="no")
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=_origin_reward([]), args=args,
                               train_dataset=text_dataset(), eval_dataset=text_dataset(4), rollout_func=rollout)  # fmt: skip
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics
    assert rollout.calls and all(c["thread"] == threading.main_thread().name for c in rollout.calls)
    assert all(math.isfinite(r) for r in [metrics["eval_reward"]])


@pytest.mark.unit
def test_rollout_func_with_tools_is_refused_with_the_reason(tmp_path, tiny_model_dir):
    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number.
        """
        return x

    with pytest.raises(NotImplementedError, match="call your tools or environment inside it"):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                         args=async_args(tmp_path), train_dataset=text_dataset(), tools=[tool],
                         rollout_func=lambda prompts, trainer: {})  # fmt: skip


class ThreadedRollout:
    """Samples each prompt from a thread pool of its own, with a shorter token budget (max_new_tokens=3)."""

    def __init__(self):
        self.threads: set[str] = set()
        self.evaluation_lengths: list[int] = []  # completion lengths sampled in evaluation (the trainer's model)

    def __call__(self, prompts, trainer):
        from concurrent.futures import ThreadPoolExecutor

        tokenizer = trainer.processing_class
        ids = [tokenizer(p)["input_ids"] for p in prompts]

        def one(prompt_ids):
            self.threads.add(threading.current_thread().name)
            out = trainer.rollout_generate([prompt_ids], max_new_tokens=3)
            if isinstance(trainer, AsyncGRPOTrainer):  # evaluation passes the trainer itself (training: a view)
                self.evaluation_lengths.append(len(out["completion_ids"][0]))
            return out

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(one, ids))
        return {"prompt_ids": ids, "completion_ids": [o["completion_ids"][0] for o in outs],
                "logprobs": [o["logprobs"][0] for o in outs], "origin": list(prompts)}  # fmt: skip


def test_a_rollout_func_sampling_from_its_own_threads_runs_in_evaluation_and_leaves_the_workers_budget(
    tmp_path, tiny_model_dir, monkeypatch
):
    from trl import GRPOTrainer

    budgets_during_eval = []  # the workers' token budget while an evaluation rollout samples with its own
    in_flight, most_in_flight = [0], [0]
    generate = GRPOTrainer._generate_single_turn

    def watched(self, *args, **kwargs):
        if not self.model.training and self._pool is not None:
            budgets_during_eval.append(self._pool.backend.specs[0].generation_config.max_new_tokens)
        in_flight[0] += 1
        most_in_flight[0] = max(most_in_flight[0], in_flight[0])
        try:
            time.sleep(0.01)  # a window for a second, unserialised call to overlap
            return generate(self, *args, **kwargs)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", watched)
    rollout = ThreadedRollout()
    args = async_args(tmp_path, max_steps=4, per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=2)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=_origin_reward([]), args=args,
                               train_dataset=text_dataset(), eval_dataset=text_dataset(4), rollout_func=rollout)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 4
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert len(evals) == 2 and all(math.isfinite(e["eval_reward"]) for e in evals)
    assert len(rollout.threads) > 1  # sampled from several threads
    assert budgets_during_eval and set(budgets_during_eval) == {6}  # max_completion_length, untouched
    assert rollout.evaluation_lengths and max(rollout.evaluation_lengths) <= 3  # the rollout's own budget applied
    assert most_in_flight[0] == 1  # the trainer's model sampled for one thread at a time
    assert trainer.generation_config.max_new_tokens == 6
