"""Construction-time checks: set-ups the rollout workers cannot serve are refused before training starts, with the
reason and what to do instead; harmless oddities only warn."""

from __future__ import annotations

import os

from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)


def unsupported_setup(model, args, quantization_config) -> str | None:
    """What in GRPOTrainer's arguments the weight sync cannot serve (``None``: nothing), checked before any model is
    loaded: FSDP (from the config or from ``accelerate launch``) and quantized base models."""
    if (args is not None and getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in (
        "true",
        "1",
    ):
        return "FSDP (fsdp in the training arguments or an accelerate FSDP config)"
    init_kwargs = (getattr(args, "model_init_kwargs", None) or {}) if args is not None else {}
    if quantization_config is not None or init_kwargs.get("quantization_config") is not None:
        return "quantized models (quantization_config)"
    if not isinstance(model, str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base, "hf_quantizer", None) is not None or any(
            getattr(base, flag, False) for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit")
        ):
            return "quantized models (the model was loaded quantized)"
    return None


def check_lora_on_tied_embeddings(model: nn.Module) -> None:
    """A LoRA adapter on an input embedding tied to the output layer: the trainer's forward adds it to the embedding
    lookup only, while a worker given the merged embedding would use it for the output layer too (the tie), sampling
    from another policy. Refused rather than silently corrected as staleness. ``model``: a peft model."""
    output_weight = getattr(model.get_output_embeddings(), "weight", None)
    for name, module in model.named_modules():
        adapters = getattr(module, "lora_embedding_A", None)
        if adapters and output_weight is not None and module.get_base_layer().weight is output_weight:
            raise NotImplementedError(
                f"LoRA on `{name}`, whose weight is tied to the output layer: the rollout workers would sample with "
                "the adapter in the output layer too, the trainer without. Leave the embedding out of "
                "target_modules (or train it fully with modules_to_save), or use a model with untied embeddings."
            )


def check_vocabulary(tokenizer, vocab: int | None) -> None:
    """Token ids past the model's embedding table crash generation only if they reach the model. The pad id (the
    trainer pads with it) is checked here; prompt tokens as each prompt is first tokenized (the row is named); eos is
    only a stop token the model emits, and bos reaches the model inside prompts. A tokenizer with unused extra ids
    (one that gained ``<|endoftext|>`` on reload) trains, as under GRPOTrainer, with a warning."""
    if vocab is None or len(tokenizer) <= vocab:
        return
    pad = tokenizer.pad_token_id
    if pad is not None and pad >= vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}, and the trainer pads "
            f"with an id past the embedding table: pad_token_id={pad} ({tokenizer.convert_ids_to_tokens(pad)!r}). "
            "Pass the model's own tokenizer, or call model.resize_token_embeddings(len(tokenizer)) before building "
            "the trainer."
        )
    extra = tokenizer.convert_ids_to_tokens(list(range(vocab, len(tokenizer))))
    logger.warning(
        f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}: {extra} are past the "
        "embedding table. Training goes on (the pad token is inside it); a prompt containing one of them fails with "
        "its row named."
    )
