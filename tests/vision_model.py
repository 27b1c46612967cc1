"""A tiny vision-language model, built offline: LLaVA with a CLIP vision tower (16x16 images, 8x8 patches: 4 image
tokens per image after the class token is dropped) and a tiny Qwen2 language model, with the character tokenizer of
``trl_async.demo.tiny`` plus an ``<image>`` token, saved with its ``LlavaProcessor``. Images are random 16x16 RGB."""

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


def random_image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8))
