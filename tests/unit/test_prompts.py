from trl.trainer.utils import RepeatSampler

from trl_async.rollout.prompts import PromptStream


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
    stream.push_front(1, 1)
    assert [stream.next_index() for _ in range(2)] == [1, 3]
    resumed = PromptStream(6, 2, shuffle=False, seed=0, skip_batches=2)
    assert resumed.next_index() == 4


def test_progress_names_exactly_the_positions_trained_when_groups_finish_out_of_order():
    stream = PromptStream(12, 2, shuffle=True, seed=3)
    drawn = [stream.next() for _ in range(6)]  # positions 0..5
    assert [p for p, _ in drawn] == list(range(6))
    stream.taken([1, 2], version=0)  # position 0 was slow: batch 0 took 1 and 2
    stream.taken([3, 0], version=1)
    stream.taken([4, 5], version=2)
    # a checkpoint after step 2 (batches taken at versions 0 and 1 complete); version 2's batch is not trained yet
    assert stream.progress(done_up_to_version=1) == {"next_position": 4, "consumed_after": []}
    assert stream.progress(done_up_to_version=0) == {"next_position": 4, "consumed_after": []}  # forgotten below 4
    other = PromptStream(12, 2, shuffle=True, seed=3)
    other.next()
    other.taken([1, 2], version=0)
    assert other.progress(done_up_to_version=0) == {"next_position": 0, "consumed_after": [1, 2]}


def test_a_stream_resumed_from_progress_skips_exactly_the_trained_positions():
    fresh = PromptStream(12, 2, shuffle=True, seed=3)
    order = [fresh.next()[1] for _ in range(8)]
    resumed = PromptStream(12, 2, shuffle=True, seed=3, skip_batches=99,
                           progress={"next_position": 1, "consumed_after": [2, 4]})  # fmt: skip
    got = [resumed.next() for _ in range(5)]
    assert got == [(1, order[1]), (3, order[3]), (5, order[5]), (6, order[6]), (7, order[7])]
    # the skipped positions stay done in the next checkpoint's summary
    resumed.taken([1, 3], version=5)
    assert resumed.progress(done_up_to_version=5) == {"next_position": 5, "consumed_after": []}


def test_a_pushed_back_prompt_keeps_its_position():
    stream = PromptStream(6, 2, shuffle=False, seed=0)
    assert [stream.next() for _ in range(3)] == [(0, 0), (1, 1), (2, 2)]
    stream.push_front(1, 1)
    assert [stream.next() for _ in range(2)] == [(1, 1), (3, 3)]
