"""Bad input fails early with a message that names the problem and the fix (or takes a documented fallback)."""

import logging

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer
from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model

from ..conftest import COMMON, async_args, letter_reward, no_rollout_children, text_dataset


def test_empty_dataset_fails_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=async_args(tmp_path),
                         train_dataset=Dataset.from_list([]))  # fmt: skip


def test_a_special_token_past_the_model_vocabulary_fails_at_construction_naming_it(tmp_path):
    tokenizer = build_char_tokenizer()
    small = build_tiny_model(build_char_tokenizer("abc"))  # a model built for a 6-token vocabulary
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})  # id 48: the trainer pads with it
    with pytest.raises(ValueError, match=r"vocabulary has 6.*pad_token_id=\d+ \('<\|pad\|>'\).*resize_token"):
        AsyncGRPOTrainer(model=small, reward_funcs=letter_reward, args=async_args(tmp_path),
                         train_dataset=text_dataset(), processing_class=tokenizer)  # fmt: skip


def test_an_unused_extra_token_trains_as_under_grpo_trainer(tmp_path, caplog):
    """A tokenizer that gained one unused special token past the table (a character tokenizer saved beside a Qwen2
    config reloads with <|endoftext|>): GRPOTrainer trains with it, so must we (with a warning)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    assert len(tokenizer) == model.config.vocab_size + 1
    GRPOTrainer(model=model, reward_funcs=letter_reward, train_dataset=text_dataset(), processing_class=tokenizer,
                args=GRPOConfig(output_dir=str(tmp_path / "sync"), **{**COMMON, "max_steps": 1})).train()  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=async_args(tmp_path, max_steps=2),
                                   train_dataset=text_dataset(), processing_class=tokenizer)  # fmt: skip
    assert "['<|endoftext|>'] are past the embedding table" in caplog.text
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_prompt_token_past_the_model_vocabulary_is_named_with_its_row(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    rows = list(text_dataset(7)) + [{"prompt": "q<|endoftext|>:", "letter": "a"}]
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=async_args(tmp_path),
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match=r"row 7: the prompt has token id 48 \('<\|endoftext\|>'\), past the model's "
                                         r"vocabulary of 48"):  # fmt: skip
        trainer.train()
    assert no_rollout_children()


def test_prompt_longer_than_the_model_limit_is_named_not_a_crash_in_a_worker(tmp_path, tiny_model_dir):
    rows = [{"prompt": "q" * 300 + ":", "letter": "a"}] + list(text_dataset(7))  # max_position_embeddings is 256
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=async_args(tmp_path),
                               train_dataset=Dataset.from_list(rows))  # fmt: skip
    with pytest.raises(ValueError, match=r"row 0: the prompt is 301 tokens.*max_position_embeddings=256"):
        trainer.train()
    assert no_rollout_children()


def test_tokenizer_without_pad_token_falls_back_to_eos_as_grpo_does(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=async_args(tmp_path, max_steps=1),
                               train_dataset=text_dataset(), processing_class=tokenizer)  # fmt: skip
    assert trainer.processing_class.pad_token == tokenizer.eos_token  # GRPOTrainer's documented fallback
    trainer.train()
    assert trainer.state.global_step == 1
