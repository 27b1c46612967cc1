"""Dynamic sampling (``dynamic_sampling=True``, rollout/filtering.py): groups whose rewards give every completion a zero
advantage never take a batch slot; other prompts are generated in their place, their admission slot is given back,
their prompts count as consumed (not retried) for the stream and for resuming, and a long run of them is an error
naming the reward functions."""

from dataclasses import replace

import pytest
import torch
from datasets import Dataset
from trl.trainer.utils import RepeatSampler

from trl_async import AsyncGRPOTrainer
from trl_async.reporting.progress import batch_metrics
from trl_async.rollout.filtering import SignalFilter, without_signal
from trl_async.rollout.scored import TakeStats

from ..conftest import async_args, no_rollout_children
from .test_resume import RecordingTrainer

nan = float("nan")
W2 = torch.tensor([1.0, 1.0])


@pytest.mark.unit
def test_a_group_has_no_signal_exactly_when_grpo_trainer_gives_it_zero_advantages():
    assert without_signal(torch.tensor([[1.0], [1.0], [1.0], [1.0]]), torch.tensor([1.0]))
    assert not without_signal(torch.tensor([[1.0], [0.0], [1.0], [1.0]]), torch.tensor([1.0]))
    # the weighted sum decides under sum_then_normalize (GRPOTrainer's default): these two functions cancel...
    cancelling = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert without_signal(cancelling, W2)
    assert not without_signal(cancelling, torch.tensor([1.0, 2.0]))  # ...unless weighted differently
    # normalize_then_sum normalises each function within the group first, (r - mean) / (std + 1e-4), then sums:
    # [+a, -a] + [-a, +a] cancel too, but not with other weights
    assert without_signal(cancelling, W2, "normalize_then_sum")
    assert not without_signal(cancelling, torch.tensor([1.0, 2.0]), "normalize_then_sum")
    assert without_signal(torch.tensor([[1.0, 3.0], [1.0, 3.0]]), W2, "normalize_then_sum")
    # a function that varies but has weight 0 (kept for logging) gives no signal, under either rule
    logged_only = torch.tensor([[1.0, 0.0], [1.0, 5.0], [1.0, 2.0]])
    assert without_signal(logged_only, torch.tensor([1.0, 0.0]))
    assert without_signal(logged_only, torch.tensor([1.0, 0.0]), "normalize_then_sum")
    assert not without_signal(logged_only, torch.tensor([0.0, 1.0]), "normalize_then_sum")
    # a value one function left unscored counts as 0 in the sum (nansum); a row no function scored is left out
    assert without_signal(torch.tensor([[nan, nan], [1.0, 0.0], [1.0, 0.0]]), W2)
    assert not without_signal(torch.tensor([[nan, 1.0], [1.0, 1.0]]), W2)  # sums 1 and 2
    assert without_signal(torch.tensor([[nan, nan], [2.0, 0.0]]), W2)  # one scored row: its advantage is 0
    # "equal" as GRPOTrainer's frac_reward_zero_std: torch.isclose(std, 0)
    assert without_signal(torch.tensor([[0.0], [1e-9]]), torch.tensor([1.0]))  # std 7e-10: not exactly equal
    assert not without_signal(torch.tensor([[1.0], [1.001]]), torch.tensor([1.0]))


@pytest.mark.unit
def test_the_filtered_fraction_is_of_the_groups_scored_since_the_previous_batch():
    stats = TakeStats(staleness=[0] * 4, queue_size=0, wait_s=0.0, dropped_samples_total=0, gen_tokens_per_s=0.0,
                      filtered_groups_total=7, filtered_since=1, kept_since=3)  # fmt: skip
    metrics = batch_metrics(stats, [], max_staleness=0, worker_restarts=0, abandoned_groups=None)
    assert metrics["async/filtered_groups"] == 7 and metrics["async/filtered_frac"] == 0.25
    none_scored = replace(stats, filtered_since=0, kept_since=0)
    assert batch_metrics(none_scored, [], 0, 0, None)["async/filtered_frac"] == 0.0
    off = replace(stats, filtered_groups_total=None)  # dynamic_sampling off: not logged
    assert "async/filtered_frac" not in batch_metrics(off, [], 0, 0, None)


@pytest.mark.unit
def test_the_filter_warns_each_batchs_worth_in_a_row_and_stops_at_its_limit(caplog):
    same, varied = torch.tensor([[0.5], [0.5]]), torch.tensor([[0.0], [1.0]])
    # 1 group per batch: a warning at 5 in a row (every 5 batches' worth), the error at 10 (limit_batches)
    f = SignalFilter(torch.tensor([1.0]), "sum_then_normalize", ["my_reward"], groups_per_batch=1, limit_batches=10)
    assert [f.keep(g) for g in (same, same, varied, same)] == [False, False, True, False]
    assert (f.filtered, f.in_a_row) == (3, 1)  # a kept group starts the count again
    assert not any(f.keep(same) for _ in range(3)) and "in a row" not in caplog.text  # 4 in a row
    assert f.keep(same) is False and "last 5 scored groups in a row" in caplog.text and "my_reward" in caplog.text
    assert not any(f.keep(same) for _ in range(4))  # 9
    with pytest.raises(RuntimeError, match=r"last 10 .* in a row.*my_reward \(weight 1\).*dynamic_sampling_limit=10"):
        f.keep(same)
    unlimited = SignalFilter(torch.tensor([1.0]), "sum_then_normalize", ["r"], groups_per_batch=1, limit_batches=None)
    assert not any(unlimited.keep(same) for _ in range(50))


ROWS = 24  # more than the run reads: every prompt it draws is from the sampler's first epoch
CONSTANT = set(range(0, ROWS, 3))  # rows 0, 3, 6, ...: every completion gets the same reward there


def dataset() -> Dataset:
    return Dataset.from_list([{"prompt": f"q{i:02d}:", "row": i} for i in range(ROWS)])


def scored_rows(seen: list):
    def reward(prompts, completions, row, **kwargs):
        seen.extend(row[:1])  # one call per group (the pool scores each group on its own)
        if row[0] in CONSTANT:
            return [0.5] * len(completions)
        return [sum(ch in "abc" for ch in c) / 6 + i * 1e-3 for i, c in enumerate(completions)]  # never all equal

    return reward


def trained(trainer) -> list[int]:
    return [p for _, ps, _ in trainer.consumed for p in ps]


def _run(tmp_path, tiny_model_dir, seen, **overrides):
    settings = {**dict(max_steps=4, max_staleness=1, seed=3, dynamic_sampling=True), **overrides}
    trainer = RecordingTrainer(model=tiny_model_dir, reward_funcs=scored_rows(seen), args=async_args(tmp_path, **settings),
                               train_dataset=dataset())  # fmt: skip
    return trainer


def test_groups_without_signal_never_train_and_their_prompts_are_not_retried(tmp_path, tiny_model_dir):
    order = list(RepeatSampler(range(ROWS), mini_repeat_count=1, batch_size=2, shuffle=True, seed=3))
    seen = []
    trainer = _run(tmp_path / "on", tiny_model_dir, seen)
    trainer.train()
    assert trainer.state.global_step == 4 and no_rollout_children()  # admission never stalled
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # every batch full (2 groups of 4), none of them without signal; the sampler's order kept, constant rows skipped
    assert [len(ps) for _, ps, _ in trainer.consumed] == [2] * 4
    assert all(h["frac_reward_zero_std"] == 0 for h in logs)
    assert trained(trainer) == [p for p in order if p not in CONSTANT][:8]
    # each prompt scored once: a filtered one counts as consumed, it is not generated again
    assert len(seen) == len(set(seen)) and CONSTANT & set(seen)
    pool = trainer.last_rollout_pool
    filtered = [p for p in seen if p in CONSTANT]
    assert pool.filtered_groups == len(filtered)
    # the logged totals only grow, and count constant groups scored before each batch was taken
    assert [h["async/filtered_groups"] for h in logs] == sorted(h["async/filtered_groups"] for h in logs)
    assert logs[-1]["async/filtered_groups"] <= pool.filtered_groups
    # the filtered prompts are done for resuming whatever a checkpoint's step: positions done at version -1 (before
    # any training) are exactly the filtered ones
    progress = pool.prompt_progress(-1)
    assert progress["next_position"] + len(progress["consumed_after"]) == pool.filtered_groups

    # off (the default): the same run trains the constant groups, as GRPOTrainer does
    off = _run(tmp_path / "off", tiny_model_dir, [], dynamic_sampling=False)
    off.train()
    assert set(trained(off)) & CONSTANT
    assert trained(off) == order[:8]
    off_logs = [h for h in off.state.log_history if "reward" in h]
    assert any(h["frac_reward_zero_std"] > 0 for h in off_logs)
    assert not any("async/filtered_groups" in h for h in off_logs)


def test_resuming_with_dynamic_sampling_neither_repeats_nor_skips(tmp_path, tiny_model_dir):
    from transformers import TrainerCallback

    straight = _run(tmp_path / "straight", tiny_model_dir, [], save_strategy="steps", save_steps=2)
    straight.train()

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    split = tmp_path / "split"
    first = _run(split, tiny_model_dir, [], save_strategy="steps", save_steps=2)
    first.add_callback(StopAtTwo())
    first.train()
    second = _run(split, tiny_model_dir, [], save_strategy="steps", save_steps=2)
    second.train(resume_from_checkpoint=str(split / "checkpoint-2"))
    assert trained(first) + trained(second) == trained(straight)
    assert not CONSTANT & set(trained(straight))


def test_a_reward_that_gives_no_signal_anywhere_stops_training_with_an_error_naming_it(tmp_path, tiny_model_dir):
    def always_half(completions, **kwargs):
        return [0.5] * len(completions)

    args = async_args(tmp_path, max_steps=4, dynamic_sampling=True, dynamic_sampling_limit=2, rollout_timeout_s=300)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=always_half, args=args, train_dataset=dataset())
    with pytest.raises(RuntimeError, match=r"last 4 scored groups in a row.*always_half \(weight 1\)"):
        trainer.train()  # long before rollout_timeout_s: the limit stops it, not a wait
    assert trainer.state.global_step == 0 and no_rollout_children()


def test_dynamic_sampling_with_a_rollout_func(tmp_path, tiny_model_dir):
    from .test_rollout_func import SingleTurn

    seen = []
    args = async_args(tmp_path, max_steps=3, max_staleness=1, seed=3, dynamic_sampling=True)
    trainer = RecordingTrainer(model=tiny_model_dir, reward_funcs=scored_rows(seen), args=args, train_dataset=dataset(),
                               rollout_func=SingleTurn())  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 3 and [len(ps) for _, ps, _ in trainer.consumed] == [2] * 3
    assert not CONSTANT & set(trained(trainer)) and trainer.last_rollout_pool.filtered_groups >= 1
    assert len(seen) == len(set(seen)) and no_rollout_children()


def test_dynamic_sampling_with_environments_and_their_tools(tmp_path, tool_model_dir):
    from .test_environments import PROMPTS, Multiplier, rows
    from .test_tools import TOOL_SETTINGS, tokenizer_of

    hello = PROMPTS.index("Say hello.")

    def varied_unless_hello(prompts, completions, **kwargs):  # the tool model is near-greedy: vary by position
        return [0.5 if prompts[0][-1]["content"] == "Say hello." else float(i) for i in range(len(completions))]

    args = async_args(tmp_path, **TOOL_SETTINGS, max_staleness=1, dynamic_sampling=True)
    trainer = RecordingTrainer(model=tool_model_dir, reward_funcs=varied_unless_hello, args=args, train_dataset=rows(),
                               processing_class=tokenizer_of(tool_model_dir), environment_factory=Multiplier)  # fmt: skip
    Multiplier.created = Multiplier.overlaps = 0  # after GRPOTrainer's own probe instance (one per factory)
    trainer.train()
    assert trainer.state.global_step == TOOL_SETTINGS["max_steps"]
    assert [len(ps) for _, ps, _ in trainer.consumed] == [3] * TOOL_SETTINGS["max_steps"]  # full batches
    assert hello not in trained(trainer) and trainer.last_rollout_pool.filtered_groups >= 2
    # the environments of filtered groups went back to the pool and were reused (fewer instances than episodes), none
    # reset while in use
    episodes = 2 * (3 * TOOL_SETTINGS["max_steps"] + trainer.last_rollout_pool.filtered_groups)
    assert Multiplier.overlaps == 0 and 0 < Multiplier.created < episodes
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logs and all(h["tools/call_frequency"] > 0 for h in logs)  # the episodes did call their tools
    assert no_rollout_children()
