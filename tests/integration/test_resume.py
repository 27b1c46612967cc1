"""Checkpoint and resume: N steps straight vs N/2, resume from the checkpoint, N/2 more."""

import pytest
from transformers import TrainerCallback

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, letter_reward, no_rollout_children, text_dataset


class RecordingTrainer(AsyncGRPOTrainer):
    """Records, per optimizer step, the prompts consumed and the oldest token version among them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed: list[tuple[int, list[int], int]] = []  # (step, prompt indices, oldest token version)
        self.prompt_ids: list[tuple[int, ...]] = []  # every consumed group's prompt, in order

    def _forward_reward_logs(self, rows):
        groups = [g.group for g, j in rows if j == 0]
        oldest = min(min(g.token_versions) for g in groups)
        self.consumed.append((self.state.global_step, [g.prompt_index for g in groups], oldest))
        self.prompt_ids += [g.prompt_ids for g in groups]
        return super()._forward_reward_logs(rows)


def _train(model_dir, out, stop_at=None, resume=None, iterable=False, **overrides):
    settings = dict(max_steps=4, max_staleness=1, save_strategy="steps", save_steps=2, seed=3)
    args = async_args(out, **{**settings, **overrides})
    data = text_dataset(12).to_iterable_dataset() if iterable else text_dataset(12)
    trainer = RecordingTrainer(model=model_dir, reward_funcs=letter_reward, args=args, train_dataset=data)
    if stop_at is not None:  # stop after the checkpoint at step 2, as a pre-empted job would

        class StopAt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == stop_at:
                    control.should_training_stop = True

        trainer.add_callback(StopAt())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_resume_consumes_the_same_prompts_with_continuous_versions(tmp_path, tiny_model_dir, iterable):
    """Also for an ``IterableDataset`` (a streaming one), whose rows are read in GRPOTrainer's order for it and kept
    by draw number: the resumed run reads the stream again and skips exactly what was trained."""
    straight = _train(tiny_model_dir, tmp_path / "straight", iterable=iterable)
    first = _train(tiny_model_dir, tmp_path / "split", stop_at=2, iterable=iterable)
    checkpoint = tmp_path / "split" / "checkpoint-2"
    assert checkpoint.is_dir()
    second = _train(tiny_model_dir, tmp_path / "split", resume=str(checkpoint), iterable=iterable)
    assert first.prompt_ids + second.prompt_ids == straight.prompt_ids  # the same rows, not only the same positions

    assert [s for s, _, _ in straight.consumed] == [0, 1, 2, 3]
    assert [s for s, _, _ in first.consumed] == [0, 1] and [s for s, _, _ in second.consumed] == [2, 3]
    resumed = first.consumed + second.consumed
    # the same prompts, in the same steps: nothing retrained, nothing skipped
    assert [p for _, p, _ in resumed] == [p for _, p, _ in straight.consumed]
    assert len({tuple(p) for _, p, _ in straight.consumed}) == 4  # steps see different prompts: a real check
    # versions continue from the checkpoint: the resumed run only trains on tokens from versions >= 2 (its own
    # weights) and never on anything older than max_staleness
    assert all(oldest >= 2 for _, _, oldest in second.consumed)
    assert all(step - oldest <= 1 for step, _, oldest in resumed)
    assert second.state.global_step == 4 and no_rollout_children()
    logs = [h for h in second.state.log_history if "async/staleness_max" in h]
    assert logs and max(h["async/staleness_max"] for h in logs) <= 1


def test_resume_inside_a_generation_batch_drops_nothing_and_follows_grpo_trainers_schedule(tmp_path, tiny_model_dir):
    """2 optimizer steps per generation batch (steps_per_generation=4, gradient_accumulation_steps=2), resumed at step
    3, inside batch 1. GRPOTrainer has no buffered batch after a resume, so it generates at step 3 from batch 1's
    prompts and then every 2 steps (5, 7, ...). Admission must expect consumption at 3, 5, not 4: with
    max_staleness=0 a batch admitted one version early is dropped as stale, doubling the generation work."""
    schedule = dict(max_steps=6, max_staleness=0, steps_per_generation=4, gradient_accumulation_steps=2,
                    save_steps=3, per_device_train_batch_size=4)  # fmt: skip
    straight = _train(tiny_model_dir, tmp_path / "straight", **schedule)
    first = _train(tiny_model_dir, tmp_path / "split", stop_at=3, **schedule)
    second = _train(tiny_model_dir, tmp_path / "split", resume=str(tmp_path / "split" / "checkpoint-3"), **schedule)

    assert [s for s, _, _ in straight.consumed] == [0, 2, 4] and [s for s, _, _ in first.consumed] == [0, 2]
    assert [s for s, _, _ in second.consumed] == [3, 5]
    batches = [p for _, p, _ in straight.consumed]
    assert len({tuple(p) for p in batches}) == 3  # batches see different prompts: a real check
    # batch 1 again at the resumed step (its completions were half used when the job stopped), then batch 2
    assert [p for _, p, _ in second.consumed] == batches[1:3]
    assert all(step == oldest for step, _, oldest in second.consumed)  # on-policy, max_staleness=0
    pool = second.last_rollout_pool
    assert pool.dropped_groups == 0  # nothing generated one version early and thrown away
    assert second.state.global_step == 6 and no_rollout_children()


def test_resume_after_out_of_order_groups_neither_repeats_nor_skips_prompts(tmp_path, tiny_model_dir):
    """Groups reach the trainer out of order (here the first prompt's reward is slow and a second scoring thread
    scores the next groups meanwhile), so the prompts trained by the checkpoint are not the first ones of the
    sampler's order. The resumed run must train the held-back prompt and nothing twice."""
    import threading

    from trl.trainer.utils import RepeatSampler

    order = list(RepeatSampler(range(12), mini_repeat_count=1, batch_size=2, shuffle=True, seed=3))
    slow_letter = "abcdefghijkl"[order[0]]
    done = threading.Event()  # the first run's checkpoint is written: the slow reward may finish

    def slow_first_prompt(prompts, completions, letter, **kwargs):
        if letter[0] == slow_letter:
            done.wait(timeout=60)
        return letter_reward(prompts, completions, letter)

    settings = dict(max_steps=4, max_staleness=3, save_strategy="steps", save_steps=2, seed=3,
                    rollout_scoring_threads=2)  # fmt: skip
    first = RecordingTrainer(model=tiny_model_dir, reward_funcs=slow_first_prompt,
                             args=async_args(tmp_path / "run", **settings), train_dataset=text_dataset(12))  # fmt: skip

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):
            done.set()

    first.add_callback(StopAtTwo())
    first.train()
    trained_first = [p for _, ps, _ in first.consumed for p in ps]
    assert order[0] not in trained_first and len(trained_first) == 4  # out of order: a real check

    second = _train(tiny_model_dir, tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"),
                    max_staleness=3, seed=3)  # fmt: skip
    trained = trained_first + [p for _, ps, _ in second.consumed for p in ps]
    assert len(trained) == len(set(trained)) == 8  # nothing trained twice (one epoch of 12 prompts)
    assert sorted(trained) == sorted(order[:8])  # nothing skipped: the first 8 prompts of the sampler's order
    assert second.state.global_step == 4 and no_rollout_children()
