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


def _stream_of(n: int):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"p{i}"} for i in range(n)]).to_iterable_dataset()


def test_an_iterable_datasets_rows_come_in_grpo_trainers_order_for_it_epoch_after_epoch():
    from trl.trainer.utils import repeat_iterable_dataset

    from trl_async.rollout.prompts import StreamedRows

    # unshuffled, worked by hand: 7 rows in generation batches of 3, the incomplete last batch (row 6) dropped
    plain = StreamedRows(_stream_of(7), 3, shuffle=False, seed=0)
    stream = PromptStream(plain, 3, shuffle=False, seed=0)
    drawn = [stream.next() for _ in range(12)]
    stream.close()
    assert [position for position, _ in drawn] == list(range(12))  # a row is its draw number, which is its position
    assert [plain[row]["prompt"] for _, row in drawn] == [f"p{i}" for i in (0, 1, 2, 3, 4, 5)] * 2
    # shuffled: GRPOTrainer's loop reads the stream shuffled with its seed, reshuffled each epoch (set_epoch)
    expected = []
    for epoch in range(3):
        order = repeat_iterable_dataset(_stream_of(7).shuffle(seed=5), mini_repeat_count=1, batch_size=3)
        order.set_epoch(epoch)
        expected += [row["prompt"] for row in order]
    shuffled = StreamedRows(_stream_of(7), 3, shuffle=True, seed=5)
    stream = PromptStream(shuffled, 3, shuffle=True, seed=5)
    got = [shuffled[stream.next()[1]]["prompt"] for _ in range(18)]
    stream.close()
    assert got == expected and got[:6] != got[6:12]  # reshuffled: a real check


def test_a_streamed_row_is_kept_until_trained_on_and_a_resumed_stream_skips_what_was():
    import pytest

    from trl_async.rollout.prompts import StreamedRows

    rows = StreamedRows(_stream_of(12), 2, shuffle=False, seed=0, ahead=1)
    stream = PromptStream(rows, 2, shuffle=False, seed=0)
    drawn = [stream.next() for _ in range(4)]
    stream.push_front(*drawn[1])  # dropped as too stale: generated again, its row still there
    assert stream.next() == drawn[1] and rows[1]["prompt"] == "p1"
    row = rows[2]
    row["prompt"] = "changed in place"  # by a reward function, say: the next read is a fresh row
    assert rows[2]["prompt"] == "p2"
    stream.taken([0, 1], version=0)
    for released in (0, 1):  # trained on: no longer held
        with pytest.raises(KeyError):
            rows[released]
    assert rows[3]["prompt"] == "p3"
    # the reader keeps at most `ahead` rows waiting beyond those drawn: 4 drawn, 2 of them released
    assert len(rows) <= 2 + 1 + 1  # (one more may be in the reader's hands, waiting for room)
    stream.close()
    # resumed from progress: positions 0-1 and 3 were trained; 2, 4, 5 come next, with their own rows, and the
    # skipped draws are never held
    again = StreamedRows(_stream_of(12), 2, shuffle=False, seed=0, ahead=1)
    resumed = PromptStream(again, 2, shuffle=False, seed=0, progress={"next_position": 2, "consumed_after": [3]})
    got = [(p, again[r]["prompt"]) for p, r in (resumed.next() for _ in range(3))]
    assert got == [(2, "p2"), (4, "p4"), (5, "p5")]
    for skipped in (0, 1, 3):
        with pytest.raises(KeyError):
            again[skipped]
    resumed.close()


def test_an_iterable_dataset_too_short_for_one_generation_batch_is_named_where_the_prompt_is_drawn():
    import pytest

    from trl_async.rollout.prompts import StreamedRows

    stream = PromptStream(StreamedRows(_stream_of(2), 3, shuffle=False, seed=0), 3, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="iterable dataset.* gave no whole generation batch in an epoch: one needs 3"):
        stream.next()
    with pytest.raises(ValueError, match="no whole generation batch"):  # and at every later draw
        stream.next()
