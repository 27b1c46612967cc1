"""Tiny vision-language models, built offline with the character tokenizer of ``trl_async.demo.tiny`` plus their
image tokens, each saved with its processor:

- LLaVA: a CLIP vision tower (16x16 images, 8x8 patches: 4 image tokens per image after the class token is dropped)
  and a tiny Qwen2 language model. Its processor gives one entry per image (``pixel_values``).
- Gemma 3: a SigLIP tower (32x32 images, 4 image tokens). Its processor also gives ``token_type_ids``, one per prompt
  token (1 on image tokens), which the forward and generation take beside the ids.
- LLaVA-NeXT: images tiled by the best of three grids, so an image gives 3 or 5 tiles of 32x32 by its shape; a batch's
  ``pixel_values`` are padded to its most tiles, and ``image_sizes`` says how many are real.
- Qwen2.5-VL and Qwen2-VL: an image becomes a run of 14x14 patches (as many as its size gives), flattened with its
  grid (``image_grid_thw``), and ``mm_token_type_ids`` marks the image tokens, which place the 3-D rotary positions.
  Their processors need a video processor, which needs torchvision; without it, ``images_only_qwen_vl`` lets them be
  built and loaded for images alone.
- Qwen3.5: as Qwen2.5-VL with 16x16 patches (Qwen3-VL's processor), interleaved 3-D rotary positions, and a language
  model of one linear-attention (gated delta rule) layer and one full-attention layer: its cache is not a plain KV
  cache.

Images are random RGB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from trl_async.demo.tiny import build_char_tokenizer

IMAGE_TOKENS = 4  # per image: (16 / 8) ** 2 patches
# the character template, with an image part rendered as the processor's <image> placeholder
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def save_tiny_llava(path: str | Path, seed: int = 0) -> Path:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    path = Path(path)
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                       tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8, projection_dim=32)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)  # fmt: skip
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def random_image(seed: int, size: tuple[int, int] = (16, 16)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def _text_config(tokenizer, **extra) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, **extra)  # fmt: skip


def _tokenizer(image_part: str, special: dict[str, str] | None = None, tokenizer=None):
    """The character tokenizer (or ``tokenizer``) with the image tokens added, its chat template rendering an image
    part as ``image_part``; ``special`` names tokens as attributes (``tokenizer.boi_token``...), as Gemma's does."""
    tokenizer = tokenizer or build_char_tokenizer()
    tokens = sorted(set((special or {}).values()) | ({image_part} if image_part.startswith("<") else set()))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    if special:
        tokenizer._set_model_specific_special_tokens(special_tokens=special)  # as a tokenizer saved with them loads
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", image_part)
    return tokenizer


GEMMA3_SPECIAL = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}


def save_tiny_gemma3(path: str | Path, seed: int = 0, tokenizer=None) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    path, tokenizer = Path(path), _tokenizer("<start_of_image>", GEMMA3_SPECIAL, tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_SPECIAL.items()}
    # Gemma 3 reads the patches, not a pooled head
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, vision_use_head=False)  # fmt: skip
    text = _text_config(tokenizer, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=ids["image_token"],
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"])  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # starts at zero (images without effect until trained): random, as a trained one is
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                image_seq_length=4)  # fmt: skip
    return _saved(path, model, processor)


LLAVA_NEXT_GRIDS = [[32, 64], [64, 32], [64, 64]]


def save_tiny_llava_next(path: str | Path, seed: int = 0, tokenizer=None) -> Path:
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    path, tokenizer = Path(path), _tokenizer("<image>", tokenizer=tokenizer)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)  # fmt: skip
    config = LlavaNextConfig(text_config={"model_type": "qwen2", **_text_config(tokenizer)}, vision_config=vision,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=LLAVA_NEXT_GRIDS, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=LLAVA_NEXT_GRIDS)  # fmt: skip
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", chat_template=tokenizer.chat_template,
                                   num_additional_image_tokens=1)  # fmt: skip
    return _saved(path, model, processor)


def _saved(path: Path, model, *processors) -> Path:
    tokenizer = getattr(processors[0], "tokenizer", processors[-1])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    for processor in processors:
        processor.save_pretrained(path)
    return path


QWEN_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def save_tiny_qwen_vl(path: str | Path, seed: int = 0, tokenizer=None, version: str = "2.5") -> Path:
    """A tiny Qwen3.5 (``version="3.5"``; ``"3.5-moe"``: its mixture of experts), Qwen2.5-VL (``"2.5"``) or Qwen2-VL
    (``"2"``) with its processor for images alone."""
    import transformers

    images_only_qwen_vl()
    path, tokenizer = Path(path), _tokenizer("".join(QWEN_VL_TOKENS[:3]), tokenizer=tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VL_TOKENS}
    text = _text_config(tokenizer, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})
    shared = dict(num_heads=2, spatial_merge_size=2, temporal_patch_size=2)
    patch = 14
    if version.startswith("3.5"):
        name = "Qwen3_5Moe" if version == "3.5-moe" else "Qwen3_5"
        classes = (f"{name}Config", f"{name}ForConditionalGeneration", "Qwen3VLProcessor")
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "mrope_interleaved": True,
                "partial_rotary_factor": 1.0}  # fmt: skip
        moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        text = _text_config(tokenizer, rope_parameters=rope, layer_types=["linear_attention", "full_attention"],
                            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8, **(moe if version == "3.5-moe" else {}))  # fmt: skip
        patch = 16
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_position_embeddings=64,
                      patch_size=patch, **shared)  # fmt: skip
    elif version == "2.5":
        classes = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor")
        # layer 0 attends within windows, layer 1 across the image
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=32, window_size=28,
                      fullatt_block_indexes=[1], patch_size=patch, **shared)  # fmt: skip
    else:
        classes = ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor")
        vision = dict(depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2, patch_size=patch, **shared)
    config_class, model_class, processor_class = (getattr(transformers, name) for name in classes)
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config)
    merged = (2 * patch) ** 2  # the pixels of one image token: 2x2 patches
    images = transformers.Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=merged * 4,
                                                   max_pixels=merged * 16)  # fmt: skip
    processor = processor_class(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return _saved(path, model, processor)


def save_tiny_qwen3_5(path: str | Path, seed: int = 0, tokenizer=None) -> Path:
    return save_tiny_qwen_vl(path, seed, tokenizer, version="3.5")


def images_only_qwen_vl() -> None:
    """Without torchvision, Qwen-VL processors are built and loaded for images alone in this process: their video
    processor needs torchvision, and the processor classes would otherwise require one."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return
    for cls in (transformers.Qwen2VLProcessor, transformers.Qwen2_5_VLProcessor, transformers.Qwen3VLProcessor):
        if "video_processor" in cls.get_attributes():
            base = cls.get_attributes.__func__
            cls.get_attributes = classmethod(lambda c, base=base: [a for a in base(c) if a != "video_processor"])
