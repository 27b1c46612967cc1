"""Dynamic sampling (``dynamic_sampling=True``, rollout/filtering.py): groups whose rewards give every completion a zero
advantage never take a batch slot; other prompts are generated in their place, their admission slot is given back,
their prompts count as consumed (not retried) for the stream and for resuming, and a long run of them is an error
naming the reward functions."""

import pytest
import torch
from datasets import Dataset
from trl.trainer.utils import RepeatSampler

from trl_async import AsyncGRPOTrainer
from trl_async.rollout.filtering import SignalFilter, without_signal

from .conftest import async_args, no_rollout_children
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
    # ...while normalize_then_sum normalises each function within the group first: both vary, so there is signal
    assert not without_signal(cancelling, W2, "normalize_then_sum")
    assert without_signal(torch.tensor([[1.0, 3.0], [1.0, 3.0]]), W2, "normalize_then_sum")
    # a value one function left unscored counts as 0 in the sum (nansum); a row no function scored is left out
    assert without_signal(torch.tensor([[nan, nan], [1.0, 0.0], [1.0, 0.0]]), W2)
    assert not without_signal(torch.tensor([[nan, 1.0], [1.0, 1.0]]), W2)  # sums 1 and 2
    assert without_signal(torch.tensor([[nan, nan], [2.0, 0.0]]), W2)  # one scored row: its advantage is 0
    # "equal" as GRPOTrainer's frac_reward_zero_std: torch.isclose(std, 0)
    assert without_signal(torch.tensor([[1.0], [1.0 + 1e-9]], dtype=torch.float64), torch.tensor([1.0]))
    assert not without_signal(torch.tensor([[1.0], [1.001]]), torch.tensor([1.0]))


@pytest.mark.unit
def test_the_filter_warns_each_batchs_worth_in_a_row_and_stops_at_its_limit(caplog):
    same, varied = torch.tensor([[0.5], [0.5]]), torch.tensor([[0.0], [1.0]])
    f = SignalFilter(torch.tensor([1.0]), "sum_then_normalize", ["my_reward"], groups_per_batch=2, limit_batches=2)
    assert [f.keep(g) for g in (same, varied, same)] == [False, True, False]
    assert (f.filtered, f.in_a_row) == (2, 1)  # a kept group starts the count again
    assert f.keep(same) is False and "last 2 scored groups in a row" in caplog.text and "my_reward" in caplog.text
    assert f.keep(same) is False
    with pytest.raises(
        RuntimeError, match=r"last 4 scored groups in a row.*my_reward \(weight 1\).*dynamic_sampling_limit=2"
    ):
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
    # the logged totals count every constant group scored before each batch was taken
    assert 1 <= logs[-1]["async/filtered_groups"] <= pool.filtered_groups
    assert logs[0]["async/filtered_frac"] == pytest.approx(
        logs[0]["async/filtered_groups"] / (logs[0]["async/filtered_groups"] + 2)
    )

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
    # every environment a filtered group used went back to the pool, none reset while in use
    free = trainer.last_rollout_pool.runner.environments._free[None]
    assert Multiplier.overlaps == 0 and len(free) == Multiplier.created
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logs and all(h["tools/call_frequency"] > 0 for h in logs)  # the episodes did call their tools
    assert no_rollout_children()
