"""Construction-time checks: set-ups the rollout workers cannot serve are refused before training starts, with the
reason and what to do instead; harmless oddities only warn."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import is_peft_model
from datasets import IterableDataset
from torch import nn
from transformers.utils import logging
from trl.data_utils import is_conversational

from ..correction.generation_modes import continuous_blocker, refused_generation, refused_paged_settings
from ..engines.transformers.continuous import paged_cache_blocker
from ..engines.transformers.slots import SlotRows, continuous_engine
from ..hardware.precision import emulated_precision_warning
from ..rollout.staleness import default_queue_size

logger = logging.get_logger(__name__)


def fsdp_version(args) -> int | None:
    """The FSDP version this run trains under (``None``: no FSDP): from ``fsdp`` in the training arguments (whose
    ``fsdp_config`` version defaults to 2, as in transformers) or from ``accelerate launch`` with an FSDP config
    (``FSDP_VERSION``, 1 when unset, as accelerate sets it)."""
    if args is not None and getattr(args, "fsdp", None):
        return int((getattr(args, "fsdp_config", None) or {}).get("version", 2))
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1"):
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


FSDP1 = (
    "FSDP1 (fsdp_version 1, accelerate's default where its config names no version): the weight sync gathers "
    "FSDP2's parameters only. Use FSDP2, as TRL and accelerate recommend: fsdp_version: 2 in the accelerate config "
    '(recipes/accelerate/fsdp2.yaml), or fsdp_config={"version": 2}'
)
QUANTIZED = (
    "its rollout workers receive the full, unquantized policy weights after every sync. Instead, train LoRA on the "
    "unquantized (e.g. bfloat16) base: with rollout_lora_sync='adapters' (the default) the workers receive the base "
    "once and then only the adapters"
)


def unsupported_setup(model, args, quantization_config) -> str | None:
    """What in GRPOTrainer's arguments the weight sync cannot serve, and why (``None``: nothing), checked before any
    model is loaded: FSDP1 (FSDP2 is served) and quantized base models."""
    if fsdp_version(args) == 1:
        return FSDP1
    init_kwargs = (getattr(args, "model_init_kwargs", None) or {}) if args is not None else {}
    if quantization_config is not None or init_kwargs.get("quantization_config") is not None:
        return f"quantized models (quantization_config): {QUANTIZED}"
    if not isinstance(model, str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base, "hf_quantizer", None) is not None or any(
            getattr(base, flag, False) for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit")
        ):
            return f"quantized models (the model was loaded quantized): {QUANTIZED}"
    return None


def check_lora_on_tied_embeddings(model: nn.Module) -> None:
    """A LoRA adapter on a weight tied to another layer (an input embedding tied to the output layer, or the output
    layer tied to the embedding): the trainer's forward adds it in the adapted layer only, while a worker given the
    merged weight would use it in both (the tie), sampling from another policy. Refused rather than silently corrected
    as staleness. ``model``: a peft model."""
    from ..weights.lora import clean_peft_name

    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    output_weight = getattr(model.get_output_embeddings(), "weight", None)
    for name, module in model.named_modules():
        if not (getattr(module, "lora_A", None) or getattr(module, "lora_embedding_A", None)):
            continue
        weight = module.get_base_layer().weight
        others = [clean_peft_name(n) for n in owners.get(id(weight), []) if not n.startswith(f"{name}.")]
        if others:
            tied = "the output layer" if weight is output_weight and getattr(module, "lora_embedding_A", None) else ""
            raise NotImplementedError(
                f"LoRA on `{name}`, whose weight is tied to {tied or 'another layer'} (`{others[0]}`): the rollout "
                "workers would sample with the adapter in both layers, the trainer with it in one. Leave it out of "
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


def refuse_before_loading(
    model, args, train_dataset, quantization_config, rollout_func, tools, environment_factory
) -> None:
    """What AsyncGRPOTrainer refuses among GRPOTrainer's arguments, checked before any model is loaded."""
    if rollout_func is not None and (tools or environment_factory is not None):
        raise NotImplementedError(
            "AsyncGRPOTrainer runs `rollout_func` without `tools`/`environment_factory`: a rollout_func owns its "
            "whole rollout, so call your tools or environment inside it (docs/agents.md, `rollout_func`), or drop "
            "`rollout_func` and let the trainer run `tools`/`environment_factory` itself."
        )
    refused = unsupported_setup(model, args, quantization_config)
    if refused:
        raise NotImplementedError(
            f"AsyncGRPOTrainer does not support {refused}. Supported: one process, DDP, DeepSpeed ZeRO-2 and ZeRO-3, "
            "FSDP2, and LoRA on an unquantized base model. Use trl.GRPOTrainer for this set-up."
        )
    if train_dataset is not None and not isinstance(train_dataset, IterableDataset) and len(train_dataset) == 0:
        raise ValueError("train_dataset is empty: AsyncGRPOTrainer needs at least one prompt to generate from.")


@dataclass(frozen=True)
class Loaded:
    """What GRPOTrainer has set up, as the checks after loading read it (trainer_view.py builds it)."""

    args: Any  # the GRPOConfig
    async_args: Any
    model: Any  # unwrapped
    device: Any  # the trainer's
    tokenizer: Any
    generation_config: Any
    train_dataset: Any
    tools: list
    num_iterations: int
    is_vlm: bool
    episodes: bool  # environment_factory or rollout_func


def check_vision_language(setup: Loaded) -> None:
    """A vision-language model trains single-turn, on transformers workers (which GRPOTrainer's own refusal of
    continuous batching for multimodal models leaves in static batches)."""
    if setup.async_args.rollout_backend != "transformers":
        refused = "vLLM servers (use rollout_backend='transformers', or trl.GRPOTrainer with vLLM)"
    elif setup.tools or setup.episodes:
        refused = "multi-turn episodes (tools, environment_factory) or a rollout_func (use trl.GRPOTrainer)"
    elif (getattr(setup.generation_config, "num_beams", 1) or 1) > 1:
        refused = "beam search (transformers expands several images per prompt out of order for beams)"
    else:
        return
    raise NotImplementedError(
        f"AsyncGRPOTrainer trains vision-language models (image prompts) on transformers workers, one turn per "
        f"prompt; not with {refused}."
    )


def check_after_loading(setup: Loaded) -> None:
    """What can only be checked once GRPOTrainer has set the trainer up (its model, tokenizer and arguments)."""
    if setup.is_vlm:
        check_vision_language(setup)
    if setup.async_args.rollout_backend == "transformers":  # the config the workers get (a plain GRPOConfig too)
        refused = refused_generation(setup.generation_config)
        if refused is not None:
            raise ValueError(f"GRPOConfig.generation_kwargs={setup.args.generation_kwargs!r} is invalid: {refused}")
        if setup.args.use_transformers_continuous_batching:
            base = setup.model
            engine = continuous_engine(setup.async_args.rollout_device or "cpu", base.config,
                                       setup.args.transformers_continuous_batching_config)  # fmt: skip
            unheld = None if engine is SlotRows else paged_cache_blocker(base.config)
            if unheld is not None:
                raise ValueError(
                    f"GRPOConfig.use_transformers_continuous_batching=True cannot serve this model: {unheld}, which "
                    "transformers' paged cache does not hold (GRPOTrainer's continuous batching fails on it too). "
                    "Set it to False: the workers generate in static batches"
                )
            blocker = continuous_blocker(setup.generation_config, slot_loop=engine is SlotRows)
            if blocker is not None:
                raise ValueError(
                    f"GRPOConfig.use_transformers_continuous_batching=True is invalid with this sampler: {blocker}. "
                    "Set it to False (static batches) or change the sampler"
                )
            refused = refused_paged_settings(setup.args.transformers_continuous_batching_config)
            if refused is not None:  # a plain GRPOConfig's (an AsyncGRPOConfig refused it when it was built)
                raise ValueError(f"GRPOConfig.transformers_continuous_batching_config is invalid: {refused}")
    data = setup.train_dataset
    first = None
    if setup.tools and data is not None:  # its first row (an iterable dataset's first record)
        first = next(iter(data), None) if isinstance(data, IterableDataset) else data[0]
    if first is not None and "prompt" in first and not is_conversational(first):
        raise ValueError(
            "`tools` need conversational prompts (lists of messages): tool calls are parsed from assistant turns "
            "with the chat template's response schema (GRPOTrainer's tool loop fails on plain-text prompts too)."
        )
    per_batch = setup.args.steps_per_generation * setup.num_iterations
    if per_batch % setup.args.gradient_accumulation_steps != 0:
        raise ValueError(
            f"steps_per_generation * num_iterations ({per_batch}) must be a multiple of "
            f"gradient_accumulation_steps ({setup.args.gradient_accumulation_steps}) so that every generation batch "
            "is consumed at one policy version; set steps_per_generation to a multiple of it."
        )
    if (setup.async_args.rollout_device or "cpu").startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"AsyncGRPOConfig.rollout_device={setup.async_args.rollout_device!r} but CUDA is not available; "
            "use rollout_device='cpu'."
        )
    model = setup.model
    check_vocabulary(setup.tokenizer, getattr(model.config.get_text_config(), "vocab_size", None))
    if is_peft_model(model):
        check_lora_on_tied_embeddings(model)
    message = emulated_precision_warning(setup.args.bf16, setup.args.fp16, setup.device)
    if message:  # the user's setting stands (GRPOTrainer's semantics); nothing else tells them what it costs
        warnings.warn(message, UserWarning, stacklevel=3)
    a = setup.async_args
    cpu_workers = a.rollout_backend == "transformers" and a.rollout_device == "cpu"
    if cpu_workers and setup.device.type == "cpu" and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":
        logger.warning(
            "The trainer and its rollout workers share the CPU cores, and OMP_WAIT_POLICY is not PASSIVE: the "
            "trainer's idle OpenMP threads spin and take cycles from the workers (fewer steps per minute: "
            "benchmarks/ARCHIVE.md, 'How the cores are split'). Set OMP_WAIT_POLICY=PASSIVE in the "
            "environment before torch is imported (the recipes do); workers get it by default."
        )


@dataclass(frozen=True)
class PoolGeometry:
    """How the pool's work is cut, computed once from the config."""

    groups_per_batch: int  # groups of one generation batch
    steps_per_batch: int  # optimizer steps one generation batch feeds
    queue_size: int  # scored groups waiting at most
    groups_per_call: int  # groups per generate call of a lane


def pool_geometry(args, num_generations: int, async_args) -> PoolGeometry:
    """The pool's geometry, with the queue checked against one batch."""
    groups_per_batch = args.generation_batch_size // num_generations
    steps_per_batch = (
        args.steps_per_generation * getattr(args, "num_iterations", 1) // args.gradient_accumulation_steps
    )
    queue_default = default_queue_size(async_args.max_staleness, steps_per_batch, groups_per_batch)
    queue_size = async_args.rollout_queue_size or queue_default
    if queue_size < groups_per_batch:
        raise ValueError(
            f"AsyncGRPOConfig.rollout_queue_size={queue_size} is smaller than one generation batch "
            f"({groups_per_batch} groups = generation_batch_size // num_generations): the trainer could never "
            f"get a full batch. Set rollout_queue_size >= {groups_per_batch} or leave it None."
        )
    per_call = async_args.rollout_batch_groups or math.ceil(groups_per_batch / async_args.num_rollout_workers)
    return PoolGeometry(groups_per_batch, steps_per_batch, queue_size, per_call)
