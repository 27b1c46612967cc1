import pytest
from trl.trainer.utils import RepeatSampler

from trl_async.prompts import PromptStream

pytestmark = pytest.mark.unit  # pure functions: part of the fast `pytest -m unit` subset


def test_prompt_order_matches_grpo_sampler_across_epochs():
    # GRPOTrainer's sampler for 10 rows, 3 unique prompts per generation batch, 4 completions each, each batch
    # repeated twice (steps_per_generation * num_iterations = 2)
    rows, b, g, repeat = 10, 3, 4, 2
    sampler = RepeatSampler(range(rows), mini_repeat_count=g, batch_size=b, repeat_count=repeat, shuffle=True, seed=7)
    expected = []
    for _ in range(3):  # three epochs; each takes b * g * repeat indices per batch, one entry per unique prompt
        indices = list(sampler)
        for start in range(0, len(indices), b * g * repeat):
            expected.extend(indices[start : start + b * g : g])
    stream = PromptStream(rows, b, shuffle=True, seed=7)
    got = [stream.next_index() for _ in range(len(expected))]
    assert got == expected and len(expected) == 3 * 9  # 9 = 3 full batches per epoch (the 10th row is dropped)


def test_pushed_back_prompt_comes_next_and_skip_resumes_position():
    stream = PromptStream(6, 2, shuffle=False, seed=0)
    assert [stream.next_index() for _ in range(3)] == [0, 1, 2]
    stream.push_front(1)
    assert [stream.next_index() for _ in range(2)] == [1, 3]
    resumed = PromptStream(6, 2, shuffle=False, seed=0, skip_batches=2)
    assert resumed.next_index() == 4
