"""A vision-language model (a tiny LLaVA built offline, tests/vision_model.py) under AsyncGRPOTrainer: the workers
sample from the processor's image tokens and pixel values, never sample the image token (GRPOTrainer suppresses it),
and the correction rebuilds that suppression, so every ratio is 1 at staleness 0; the vision tower learns."""

import json

import pytest
import torch
from datasets import Dataset

from tests.conftest import async_args
from tests.vision_model import IMAGE_TOKENS, random_image, save_tiny_llava
from trl_async import AsyncGRPOTrainer


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return str(save_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava"))


def image_count(i: int) -> int:
    return 2 if i % 3 == 0 else 1  # every third row shows two images


def vision_rows(n: int = 12) -> Dataset:
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"what is {i}?"}],
                "images": [random_image(10 * i + k) for k in range(image_count(i))],
            }  # fmt: skip
            for i in range(n)
        ]
    )


def vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c[0]["content"])) for c in completions]


def test_a_vision_language_model_trains_with_every_ratio_one_at_staleness_0(tmp_path, llava_dir):
    args = async_args(tmp_path, max_steps=3, max_staleness=0, rollout_trajectory_file="traj.jsonl",
                      learning_rate=0.05)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=llava_dir, reward_funcs=vowels, args=args, train_dataset=vision_rows())
    vision = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "vision_tower" in n}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert len(logs) == 3 and all(h["async/staleness_max"] == 0 for h in logs)
    for h in logs:  # the workers' mu (image token suppressed) is the trainer's processed distribution, token for token
        assert abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3, h
    moved = [n for n, p in trainer.model.named_parameters() if n in vision and not torch.equal(p.detach(), vision[n])]
    assert len(moved) >= len(vision) // 2, (len(moved), len(vision))  # the vision tower received gradients
    image_token = trainer.model.config.image_token_id
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 8
    for row in rows:  # the processor's image tokens, one run of them per image, reached the workers
        assert row["prompt_ids"].count(image_token) == IMAGE_TOKENS * image_count(row["prompt_index"])
        assert image_token not in row["completion_ids"]


def test_a_stale_policy_is_corrected_on_image_prompts(tmp_path, llava_dir):
    """At staleness 1 the ratio moves away from 1 (the weights changed since the workers sampled), and stays finite:
    the correction weighs image prompts as it weighs text."""
    args = async_args(tmp_path, max_steps=4, max_staleness=1, learning_rate=0.05)
    trainer = AsyncGRPOTrainer(model=llava_dir, reward_funcs=vowels, args=args, train_dataset=vision_rows())
    trainer.train()
    stale = [h for h in trainer.state.log_history if h.get("async/staleness_max") == 1]
    assert stale, trainer.state.log_history
    assert all(h["is/behaviour_nan"] == 0 and 0 < h["is/ratio_min"] <= h["is/ratio_max"] < 1e3 for h in stale)
    assert any(h["is/ratio_max"] - h["is/ratio_min"] > 1e-3 for h in stale)


@pytest.mark.parametrize(
    "overrides,extra,says",
    [
        ({"rollout_backend": "vllm", "rollout_vllm_urls": ["http://127.0.0.1:9"]}, {}, "not with vLLM servers"),
        ({}, {"rollout_func": lambda prompts, trainer: {}}, "not with multi-turn episodes .* or a rollout_func"),
    ],
    ids=["vllm", "rollout_func"],
)
def test_what_vision_language_training_does_not_cover_is_refused_with_what_to_do(
    tmp_path, llava_dir, overrides, extra, says
):
    with pytest.raises(NotImplementedError, match=says):
        AsyncGRPOTrainer(model=llava_dir, reward_funcs=vowels, args=async_args(tmp_path, **overrides),
                         train_dataset=vision_rows(), **extra)  # fmt: skip


def test_images_inside_the_messages_reach_the_workers_as_from_an_image_column(tmp_path, llava_dir):
    """A dataset may carry its images in the messages' image parts (no image column): the pool renders them as
    GRPOTrainer does, token for token, and the workers get their pixel values."""
    from datasets import Features, Image, List, Value
    from trl import GRPOTrainer

    from trl_async.setup.rendering import make_tokenize_row
    from trl_async.setup.trainer_view import pool_inputs

    part = {"type": Value("string"), "image": Image(), "text": Value("string")}  # images decoded on access
    features = Features({"prompt": List({"role": Value("string"), "content": List(part)})})
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": random_image(i), "text": None},
                                                 {"type": "text", "image": None, "text": f"what is {i}?"}]}]}
        for i in range(8)
    ]  # fmt: skip
    args = async_args(tmp_path, max_steps=2, max_staleness=0)
    trainer = AsyncGRPOTrainer(
        model=llava_dir, reward_funcs=vowels, args=args, train_dataset=Dataset.from_list(rows, features=features)
    )
    ids, images = make_tokenize_row(pool_inputs(trainer))(0, trainer.train_dataset[0])
    assert list(ids) == list(GRPOTrainer._tokenize_prompts(trainer, [trainer.train_dataset[0]["prompt"]])[0][0])
    assert images["pixel_values"].shape == (1, 3, 16, 16)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert len(logs) == 2 and all(
        abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3 for h in logs
    )
