"""Tiny, local, offline models and tokenizers for the CPU demo, tests and benchmarks (no hub access needed).

A character-level tokenizer (one token per character; small vocabularies keep CPU steps fast) and a small Qwen2
causal LM built from a config, both saved with ``save_pretrained`` so they load by path like any hub model.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
DEFAULT_CHARS = string.ascii_lowercase + string.digits + " +-=:?.,\n"
# Minimal chat template over the characters above: "u:...\na:" style turns.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(chars)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Qwen2ForCausalLM:
    import torch

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str | Path, chars: str = DEFAULT_CHARS, **model_kwargs) -> Path:
    """Build and save a tiny model and its tokenizer under ``path``; returns the path (loadable by name)."""
    path = Path(path)
    tokenizer = build_char_tokenizer(chars)
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
