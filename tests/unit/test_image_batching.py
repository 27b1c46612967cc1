"""How a rollout worker batches the image inputs of several vision-language prompts: per-image fields in row order,
per-token fields left-padded with the prompt ids, and LLaVA-NeXT's tiles padded to the batch's most. What each model's
processor gives for the same rows is the reference in tests/integration/test_vision.py."""

import numpy as np
import pytest
import torch

from trl_async.engines.transformers.worker import batched_images
from trl_async.records import RolloutTask


def task(prompt_len: int, images: dict) -> RolloutTask:
    return RolloutTask(0, 0, tuple(range(prompt_len)), 0, images={k: np.asarray(v) for k, v in images.items()})


def test_per_token_fields_are_left_padded_with_zeros_to_the_batch_width_once_per_row():
    a = task(3, {"token_type_ids": [[0, 1, 0]], "pixel_values": np.full((1, 2), 7.0)})
    b = task(5, {"token_type_ids": [[1, 1, 0, 0, 1]], "pixel_values": np.full((1, 2), 9.0)})
    out = batched_images([a, b], rows_per_task=[2, 1], width=5, device="cpu")
    assert out["token_type_ids"].tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 1, 0], [1, 1, 0, 0, 1]]
    assert out["pixel_values"].tolist() == [[7.0, 7.0], [7.0, 7.0], [9.0, 9.0]]  # one entry per image, row order


def test_a_task_without_a_per_token_field_gets_zeros_and_a_field_of_the_wrong_length_is_refused():
    text_only = task(2, {})  # a row without images, batched with one that has them
    out = batched_images([text_only, task(3, {"token_type_ids": [[1, 1, 0]]})], [1, 1], width=3, device="cpu")
    assert out["token_type_ids"].tolist() == [[0, 0, 0], [1, 1, 0]]
    with pytest.raises(ValueError, match="token_type_ids has 4 entries for a prompt of 3 tokens"):
        batched_images([task(3, {"token_type_ids": [[1, 1, 0, 0]]})], [1], width=4, device="cpu")


def tiled(tiles: int, side: int = 2) -> RolloutTask:  # one image of `tiles` tiles, with its size
    return task(1, {"pixel_values": np.ones((1, tiles, 3, side, side)), "image_sizes": [[side, side]]})


def test_tiles_are_padded_with_zeros_to_the_batch_most_and_other_shapes_refused():
    out = batched_images([tiled(3), tiled(5)], [1, 1], 1, "cpu")
    assert out["pixel_values"].shape == (2, 5, 3, 2, 2)
    assert out["pixel_values"][0, :3].eq(1).all() and out["pixel_values"][0, 3:].eq(0).all()
    assert out["pixel_values"][1].eq(1).all()
    with pytest.raises(ValueError, match="pixel_values of different shapes"):
        batched_images([tiled(3), tiled(3, side=4)], [1, 1], 1, "cpu")  # tiles of another size: not padding
    untiled = [task(1, {"pixel_values": np.ones((1, n, 2, 2))}) for n in (3, 5)]  # no image_sizes: not tiles
    with pytest.raises(ValueError, match="pixel_values of different shapes"):
        batched_images(untiled, [1, 1], 1, "cpu")


def test_a_batch_of_one_shape_is_concatenated_as_it_is():
    grid = [[1, 2, 2]]
    out = batched_images([task(1, {"image_grid_thw": grid}), task(1, {"image_grid_thw": grid})], [1, 2], 1, "cpu")
    assert torch.equal(out["image_grid_thw"], torch.tensor([[1, 2, 2]] * 3))
