"""A vision-language model (a tiny LLaVA built offline, tests/vision_model.py) under AsyncGRPOTrainer: the workers
sample from the processor's image tokens and pixel values, never sample the image token (GRPOTrainer suppresses it),
and the correction rebuilds that suppression, so every ratio is 1 at staleness 0; the vision tower learns."""

import json

import pytest
import torch
from datasets import Dataset

from tests.conftest import async_args
from tests.vision_model import (
    IMAGE_TOKENS,
    random_image,
    save_tiny_gemma3,
    save_tiny_llava,
    save_tiny_llava_next,
    save_tiny_qwen3_5,
    save_tiny_qwen_vl,
)
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


@pytest.mark.parametrize(
    "save",
    [save_tiny_gemma3, save_tiny_llava_next, save_tiny_qwen_vl, save_tiny_qwen3_5],
    ids=["gemma3", "llava_next", "qwen2_5_vl", "qwen3_5"],
)
def test_processors_with_per_token_fields_or_tiles_train_with_every_ratio_one_at_staleness_0(tmp_path, save):
    """Gemma 3's processor gives ``token_type_ids`` (one per prompt token), LLaVA-NeXT's tiles each image by its
    shape (16x16: 3 tiles, 48x40: 5), Qwen2.5-VL's and Qwen3.5's flatten a size-dependent number of patches and mark
    image tokens in ``mm_token_type_ids`` (3-D rotary positions; Qwen3.5's language model has a linear-attention
    layer, whose cache is a recurrent state, not keys and values): the workers batch prompts of both sizes together,
    padded as GRPOTrainer's batch is, and sample exactly what the trainer's forward gives for the same inputs."""
    model_dir = str(save(tmp_path / "model"))
    rows = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"what is {i}?"}],
          "images": [random_image(10 * i + k, (16, 16) if i % 2 else (48, 40)) for k in range(image_count(i))]}
         for i in range(8)]
    )  # fmt: skip
    args = async_args(tmp_path, max_steps=2, max_staleness=0, learning_rate=0.05)
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=vowels, args=args, train_dataset=rows)
    vision = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n or "vision" in n}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert len(logs) == 2
    for h in logs:
        assert abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3, h
    moved = [n for n, p in trainer.model.named_parameters() if n in vision and not torch.equal(p.detach(), vision[n])]
    assert moved, "the vision tower received no gradient"


@pytest.mark.parametrize(
    "save",
    [save_tiny_gemma3, save_tiny_llava_next, save_tiny_qwen_vl, save_tiny_qwen3_5],
    ids=["gemma3", "llava_next", "qwen2_5_vl", "qwen3_5"],
)
def test_the_workers_batch_is_the_processors_batch_of_the_same_rows(tmp_path, save):
    """Rows rendered one at a time by the processor (as the pool renders them) and batched by a worker give the model
    the inputs the processor's own batched call gives for the same rows (GRPOTrainer's generate inputs): per-token
    fields left-padded, tiles padded to the batch's most, images in row order; rows with 0, 1 and 2 images of two
    sizes."""
    from transformers import AutoProcessor

    from trl_async.engines.transformers.decoding import left_padded
    from trl_async.engines.transformers.worker import batched_images
    from trl_async.records import RolloutTask
    from trl_async.rollout.images import prompt_with_images

    processor = AutoProcessor.from_pretrained(str(save(tmp_path / "model")), padding_side="left")
    sizes = [(16, 16), (48, 40), (20, 36)]
    prompts = [
        prompt_with_images([{"role": "user", "content": f"what is {i}?"}],
                           [random_image(10 * i + k, sizes[(i + k) % 3]) for k in range(i % 3)] or None)
        for i in range(6)
    ]  # fmt: skip

    def render(conversations):
        return processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                             return_dict=True, return_tensors="pt", padding=True)  # fmt: skip

    tasks = []
    for prompt in prompts:
        out = render([prompt])
        fields = {k: v.numpy() for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        tasks.append(RolloutTask(0, 0, tuple(out["input_ids"][0].tolist()), 0, images=fields))
    input_ids, _ = left_padded([t.prompt_ids for t in tasks], processor.tokenizer.pad_token_id)
    ours = batched_images(tasks, [1] * len(tasks), input_ids.size(1), "cpu")
    theirs = render(prompts)
    assert torch.equal(input_ids, theirs["input_ids"])
    assert set(ours) == set(theirs) - {"input_ids", "attention_mask"}
    for key, value in theirs.items():
        if key not in ("input_ids", "attention_mask"):
            assert torch.equal(ours[key], value), key


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


def with_output(processor, key: str, value_of):
    """``processor`` whose chat-template output also carries ``key`` (``value_of(output)``), as another model
    family's processor would."""
    base = type(processor)

    class Extra(base):
        def apply_chat_template(self, *args, **kwargs):
            out = base.apply_chat_template(self, *args, **kwargs)
            out[key] = value_of(out)
            return out

    processor.__class__ = Extra
    return processor


@pytest.mark.parametrize(
    "key,value_of,says",
    [
        ("pixel_attention_mask", lambda out: torch.ones(1, 1, 16, 16, dtype=torch.long),
         r"row 0: the processor gives \['pixel_attention_mask'\] beside the pixel values"),
        ("token_type_ids", lambda out: torch.zeros(1, out["input_ids"].size(1) - 1, dtype=torch.long),
         r"row 0: the processor's token_type_ids has \d+ entries for a prompt of \d+ tokens"),
    ],
    ids=["unknown_field", "per_token_field_of_another_length"],
)  # fmt: skip
def test_a_row_the_workers_cannot_batch_is_refused_with_the_row_and_the_field_named(llava_dir, key, value_of, says):
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoProcessor

    from trl_async.setup.rendering import make_tokenize_row

    inputs = SimpleNamespace(
        processing_class=with_output(AutoProcessor.from_pretrained(llava_dir), key, value_of),
        chat_template=None, chat_template_kwargs={}, tools=None,
        model=SimpleNamespace(config=AutoConfig.from_pretrained(llava_dir)),
        sampling=SimpleNamespace(max_completion_length=8),
    )  # fmt: skip
    tokenize_row = make_tokenize_row(inputs)
    row = vision_rows(1)[0]
    with pytest.raises(ValueError, match=says):
        tokenize_row(0, row)
