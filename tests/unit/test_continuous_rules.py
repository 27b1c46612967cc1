import pytest
import torch
from transformers import GenerationConfig

from trl_async.correction.generation_modes import continuous_blocker, refused_paged_settings
from trl_async.engines.transformers.continuous import (
    ContinuousRows,
    continuous_slots,
    cut_at_eos,
    paged_settings,
    versions_of,
)
from trl_async.engines.transformers.slot_cache import columns_cache, first_used, left_pad, positions, relaid
from trl_async.engines.transformers.slots import SlotRows, continuous_engine, slot_loop_blocker


def test_samplers_that_read_a_rows_history_or_search_beams_keep_static_batches():
    assert continuous_blocker(GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)) is None
    assert "repetition_penalty=1.2" in continuous_blocker(GenerationConfig(do_sample=True, repetition_penalty=1.2))
    assert "min_new_tokens=3" in continuous_blocker(GenerationConfig(min_new_tokens=3))
    assert "no_repeat_ngram_size=2" in continuous_blocker(GenerationConfig(no_repeat_ngram_size=2))
    assert "beam search" in continuous_blocker(GenerationConfig(num_beams=2))
    assert continuous_blocker(GenerationConfig(min_new_tokens=0)) is None
    # the slot loop applies the repetition penalty and min_new_tokens per row; the paged engine neither
    penalised = GenerationConfig(do_sample=True, repetition_penalty=1.2, min_new_tokens=3)
    assert continuous_blocker(penalised, slot_loop=True) is None
    assert "paged engine does not apply" in continuous_blocker(penalised)
    assert "no_repeat_ngram_size=2" in continuous_blocker(GenerationConfig(no_repeat_ngram_size=2), slot_loop=True)
    assert "beam search" in continuous_blocker(GenerationConfig(num_beams=2), slot_loop=True)


def test_the_users_paged_engine_settings_are_taken_unless_they_would_break_mu_or_the_swap():
    assert refused_paged_settings(None) is None
    assert refused_paged_settings({"scheduler_type": "prefill_first", "num_blocks": 64}) is None
    assert "return_logprobs=False cannot be used" in refused_paged_settings({"return_logprobs": False})
    assert "allow_block_sharing=True cannot be used" in refused_paged_settings({"allow_block_sharing": True})
    assert "use_async_batching=True" in refused_paged_settings({"use_async_batching": True})
    assert "cpu_offload_space=2.0" in refused_paged_settings({"cpu_offload_space": 2.0})
    assert refused_paged_settings({"return_logprobs": True}) is None  # what the workers set anyway
    assert "ContinuousBatchingConfig refuses it" in refused_paged_settings({"max_batch_tokenz": 8})
    assert "page_size=0: give a whole number" in refused_paged_settings({"page_size": 0})


def test_the_paged_cache_holds_every_slot_unless_the_user_sizes_it():
    # 4 slots of 100 tokens in pages of 32: 4 pages each plus one
    assert paged_settings(4, 100) == dict(
        page_size=32,
        max_batch_tokens=256,
        num_blocks=20,
        return_logprobs=True,
        allow_block_sharing=False,
        use_async_batching=False,
        cpu_offload_space=0.0,
    )
    assert paged_settings(4, 100, {"page_size": 64})["num_blocks"] == 4 * (2 + 1)
    assert paged_settings(4, 100, {"block_size": 64})["num_blocks"] == 4 * (2 + 1)  # page_size's older name
    # the user sizes the cache: in transformers' own pages (its default page_size), not the workers' 32
    assert {"num_blocks", "page_size"}.isdisjoint(paged_settings(4, 100, {"max_memory_percent": 0.3}))
    user = paged_settings(4, 100, {"num_blocks": 7, "scheduler_type": "prefill_first"})
    assert user["num_blocks"] == 7 and "page_size" not in user
    assert paged_settings(4, 100, {"return_logprobs": True})["return_logprobs"] is True


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
    assert continuous_engine("cpu", full, {"scheduler_type": "fifo"}) is ContinuousRows  # the user configured it


def test_the_paged_engine_holds_full_and_sliding_attention_and_names_the_layers_it_cannot_hold():
    from transformers import MistralConfig, Qwen3_5Config, Qwen3_5TextConfig

    from trl_async.engines.transformers.continuous import paged_cache_blocker

    sliding = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            sliding_window=8)  # fmt: skip
    hybrid = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                  layer_types=["linear_attention", "full_attention"] * 2)  # fmt: skip
    assert paged_cache_blocker(sliding) is None
    assert paged_cache_blocker(Qwen3_5TextConfig(**{**hybrid, "layer_types": ["full_attention"] * 4})) is None
    assert "linear_attention" in paged_cache_blocker(Qwen3_5TextConfig(**hybrid))
    # a vision-language model's language model is what generates
    assert "linear_attention" in paged_cache_blocker(Qwen3_5Config(text_config=hybrid))


def test_a_cache_layer_writes_each_step_in_place_and_doubles_when_out_of_room():
    keys = torch.arange(2 * 1 * 3 * 1, dtype=torch.float).view(2, 1, 3, 1)
    cache = columns_cache([(keys, -keys)], width=4, room=1)  # right-aligned at 4: one zero column in front
    (layer,) = cache.layers
    assert layer.capacity == 5 and layer.keys[0, 0, :, 0].tolist() == [0, 0, 1, 2]
    buffer = layer.buffers[0]
    step = torch.full((2, 1, 1, 1), 9.0)
    layer.update(step, -step)
    assert layer.buffers[0] is buffer and layer.keys[1, 0, :, 0].tolist() == [0, 3, 4, 5, 9]  # in place
    layer.update(step, -step)  # no room left: the buffers double
    assert layer.capacity == 10 and layer.keys.shape[2] == 6 and layer.values[1, 0, -1, 0] == -9
    layer.put(0, torch.ones(1, 2, 1), torch.ones(1, 2, 1))  # a joining row: right-aligned, zeros before it
    assert layer.keys[0, 0, :, 0].tolist() == [0, 0, 0, 0, 1, 1]


def test_a_re_layout_keeps_the_chosen_rows_from_their_first_used_column_and_adds_free_ones():
    keys = torch.arange(3 * 4, dtype=torch.float).view(3, 1, 4, 1)
    cache = columns_cache([(keys, keys)], room=0)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    keep = torch.tensor([0, 2])
    start = first_used(mask[keep])
    assert start == 1
    (layer,) = relaid(cache, keep, start, extra_rows=1, width=3, room=2).layers
    assert layer.capacity == 5 and layer.keys.shape == (3, 1, 3, 1)
    assert layer.keys[:, 0, :, 0].tolist() == [[1, 2, 3], [9, 10, 11], [0, 0, 0]]


def test_rows_are_left_padded_to_the_longest_with_a_mask_of_their_own_tokens():
    from trl_async.engines.transformers.decoding import left_padded

    ids, mask = left_padded([(5, 6, 7), (8,)], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
