"""Local stand-ins for the Hub names TRL's GRPOTrainer tests load (``trl-internal-testing/...``), under the same
names: the "zen" prompt datasets from the Zen of Python (text; one image per row; several images per row), and small,
randomly initialised models of the same classes (Qwen2, Gemma 2 and a Llama classifier with SmolLM2's tokenizer; Qwen3
and Qwen3-MoE with the same tokenizer speaking Qwen3's chat template; Gemma 3, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL,
Qwen3.5 and Qwen3.5-MoE built by ``tests/vision_model.py``, with SmolLM2's tokenizer)."""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT_MODELS = ("tiny-Qwen2ForCausalLM-2.5", "tiny-Qwen2ForSequenceClassification-2.5")


def build_standins(hub: Path) -> None:
    """Every stand-in under ``hub`` (the ``trl-internal-testing`` folder)."""
    build_zen(hub / "zen")
    build_zen_images(hub)
    build_models(hub)
    build_more_models(hub)
    build_vision_models(hub)


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen of Python; its text is kept rot13-encoded in this.s)

    text = codecs.decode(sys.modules["this"].s, "rot13")
    return [line for line in text.splitlines()[1:] if line.strip()]


def build_zen(folder: Path) -> None:
    """``trl-internal-testing/zen``'s prompt-only configurations: a train split and a small test split."""
    from datasets import Dataset

    lines = zen_lines()
    prompts = [line.rsplit(" ", 1)[0] for line in lines]
    splits = {"train": prompts[:-2], "test": prompts[-2:]}
    configs = {
        "standard_prompt_only": lambda p: {"prompt": p},
        "conversational_prompt_only": lambda p: {"prompt": [{"role": "user", "content": f"Complete: {p}"}]},
    }
    _card(folder, {name: {split: Dataset.from_list([row(p) for p in rows]) for split, rows in splits.items()}
                   for name, row in configs.items()})  # fmt: skip


def qwen3_tokenizer():
    """SmolLM2's tokenizer speaking Qwen3's chat template (TRL's copy, which it recognises for tool calls), with
    Qwen3's tool and thinking tags as plain added tokens and its padding token."""
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = smollm2_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def build_more_models(folder: Path) -> None:
    """Tiny Qwen3 (dense, mixture-of-experts, sequence classifier) with Qwen3's chat template, Gemma 2, and a Llama
    sequence classifier, under TRL's test names."""
    import torch
    import transformers as tf

    qwen3, smol = qwen3_tokenizer(), smollm2_tokenizer()
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=4, max_position_embeddings=512)  # fmt: skip

    def ids(tokenizer):
        return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id)  # fmt: skip

    models = {
        "tiny-Qwen3ForCausalLM": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**shape, **ids(qwen3)), qwen3),
        "tiny-Qwen3MoeForCausalLM": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(**shape, **ids(qwen3), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
            qwen3,
        ),
        "tiny-Qwen3ForSequenceClassification": (
            tf.Qwen3ForSequenceClassification, tf.Qwen3Config(**shape, **ids(qwen3), num_labels=1), qwen3),
        "tiny-Gemma2ForCausalLM": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**shape, **ids(smol)), smol),
        "tiny-LlamaForSequenceClassification-3.2": (
            tf.LlamaForSequenceClassification, tf.LlamaConfig(**shape, **ids(smol), num_labels=1), smol),
    }  # fmt: skip
    for name, (cls, config, tokenizer) in models.items():
        torch.manual_seed(0)
        cls(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


def build_models(folder: Path) -> None:
    """Tiny Qwen2 models under TRL's test names, with SmolLM2's tokenizer (and chat template)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tokenizer = smollm2_tokenizer()
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    for name, cls in zip(TEXT_MODELS, (Qwen2ForCausalLM, Qwen2ForSequenceClassification), strict=True):
        model = cls(Qwen2Config(**shape, num_labels=1) if "Sequence" in name else Qwen2Config(**shape))
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trl_async.demo.pretrained import smollm2_135m_instruct

    tokenizer = AutoTokenizer.from_pretrained(smollm2_135m_instruct())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _card(folder: Path, configs: dict[str, dict]) -> None:
    """``configs``: name -> split -> Dataset; each written as parquet under ``folder``, with the card naming them."""
    card = ["---", "configs:"]
    for name, splits in configs.items():
        card += [f"- config_name: {name}", "  data_files:"]
        for split, dataset in splits.items():
            dataset.to_parquet(str(folder / name / f"{split}.parquet"))
            card += [f"  - split: {split}", f"    path: {name}/{split}.parquet"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))


def build_zen_images(hub: Path) -> None:
    """``zen-image`` (a question per row, one random image of 32-64 pixels a side) and ``zen-multi-image`` (the
    image parts inside the messages, 0 to 3 per row, with an ``images`` column), ``conversational_prompt_only``."""
    from datasets import Dataset, Features, Image, List, Value

    rng = np.random.default_rng(0)
    questions = [f"What follows: {line.rsplit(' ', 1)[0]}?" for line in zen_lines()]

    def image():
        return rng.integers(0, 255, (*rng.integers(32, 65, 2), 3), dtype=np.uint8)

    def split(rows: list, features) -> dict:
        return {"train": Dataset.from_list(rows[:-2], features=features),
                "test": Dataset.from_list(rows[-2:], features=features)}  # fmt: skip

    message = {"role": Value("string"), "content": Value("string")}
    one = [{"prompt": [{"role": "user", "content": q}], "image": image()} for q in questions]
    _card(hub / "zen-image", {"conversational_prompt_only": split(one, Features(prompt=List(message), image=Image()))})
    part = {"type": Value("string"), "text": Value("string")}
    features = Features(prompt=List({"role": Value("string"), "content": List(part)}), images=List(Image()))
    several = []
    for i, q in enumerate(questions):
        count = i % 4  # 0, 1, 2, 3 images, before and after the text
        parts = [{"type": "image", "text": None}] * (count // 2) + [{"type": "text", "text": q}]
        parts += [{"type": "image", "text": None}] * (count - count // 2)
        several.append({"prompt": [{"role": "user", "content": parts}], "images": [image() for _ in range(count)]})
    _card(hub / "zen-multi-image", {"conversational_prompt_only": split(several, features)})


def build_vision_models(hub: Path) -> None:
    """Tiny Gemma 3, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3.5 and Qwen3.5-MoE under TRL's test names, with SmolLM2's
    tokenizer."""
    sys.path.insert(0, str(ROOT))
    from tests.vision_model import save_tiny_gemma3, save_tiny_llava_next, save_tiny_qwen_vl

    save_tiny_gemma3(hub / "tiny-Gemma3ForConditionalGeneration", tokenizer=smollm2_tokenizer())
    save_tiny_llava_next(hub / "tiny-LlavaNextForConditionalGeneration", tokenizer=smollm2_tokenizer())
    save_tiny_qwen_vl(hub / "tiny-Qwen2VLForConditionalGeneration", tokenizer=smollm2_tokenizer(), version="2")
    save_tiny_qwen_vl(hub / "tiny-Qwen2_5_VLForConditionalGeneration", tokenizer=smollm2_tokenizer())
    for name, version in (("Qwen3_5ForConditionalGeneration-NoThink", "3.5"),
                          ("Qwen3_5MoeForConditionalGeneration-3.6", "3.5-moe")):  # fmt: skip
        save_tiny_qwen_vl(hub / f"tiny-{name}", tokenizer=smollm2_tokenizer(), version=version)
