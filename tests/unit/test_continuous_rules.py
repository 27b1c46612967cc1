import pytest
import torch
from transformers import GenerationConfig

from trl_async.engines.transformers.continuous import (
    ContinuousRows,
    continuous_blocker,
    continuous_slots,
    cut_at_eos,
    versions_of,
)
from trl_async.engines.transformers.slots import SlotRows, continuous_engine, left_pad, positions, slot_loop_blocker


def test_samplers_that_read_a_rows_history_or_search_beams_keep_static_batches():
    assert continuous_blocker(GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)) is None
    assert "repetition_penalty=1.2" in continuous_blocker(GenerationConfig(do_sample=True, repetition_penalty=1.2))
    assert "min_new_tokens=3" in continuous_blocker(GenerationConfig(min_new_tokens=3))
    assert "no_repeat_ngram_size=2" in continuous_blocker(GenerationConfig(no_repeat_ngram_size=2))
    assert "beam search" in continuous_blocker(GenerationConfig(num_beams=2))
    assert continuous_blocker(GenerationConfig(min_new_tokens=0)) is None


def test_slots_are_the_rollout_batch_in_rows_when_on():
    assert continuous_slots(True, groups_per_call=2, num_generations=4) == 8
    assert continuous_slots(False, groups_per_call=2, num_generations=4) == 0


def test_a_row_s_tokens_take_the_version_that_began_at_or_before_them():
    # started at version 3; weights swapped after its 2nd token (version 4) and after its 5th (version 5)
    assert versions_of([(0, 3), (2, 4), (5, 5)], 7) == (3, 3, 4, 4, 4, 5, 5)
    # swapped before its first token: the later mark at the same index wins
    assert versions_of([(0, 3), (0, 4)], 3) == (4, 4, 4)
    assert versions_of([(0, 3)], 0) == ()


@pytest.mark.parametrize(
    "tokens,budget,kept", [((5, 6, 2, 7), None, 3), ((5, 6, 7), None, 3), ((5, 2, 2), 1, 1), ((5, 6, 7, 8), 2, 2)]
)
def test_a_completion_ends_at_its_first_eos_within_its_budget(tokens, budget, kept):
    assert cut_at_eos(tokens, {2}, budget) == kept


def test_left_pad_puts_zeros_in_front_and_leaves_a_wide_enough_tensor_alone():
    t = torch.tensor([[1, 2], [3, 4]])
    assert left_pad(t, 4, 1).tolist() == [[0, 0, 1, 2], [0, 0, 3, 4]]
    assert left_pad(t, 2, 1) is t and left_pad(t, 1, 1) is t
    assert left_pad(t, 3, 0).tolist() == [[0, 0], [1, 2], [3, 4]]


def test_positions_count_each_rows_own_tokens_from_zero():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert positions(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


def test_the_slot_loop_takes_full_attention_models_on_a_cpu_and_leaves_the_rest_to_the_paged_engine():
    from transformers import LlamaConfig, MistralConfig

    full = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    sliding = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            sliding_window=8)  # fmt: skip
    assert slot_loop_blocker(full) is None
    assert "DynamicSlidingWindowLayer" in slot_loop_blocker(sliding)
    assert continuous_engine("cpu", full) is SlotRows
    assert continuous_engine("cpu", sliding) is ContinuousRows
    assert continuous_engine("cuda:0", full) is ContinuousRows
