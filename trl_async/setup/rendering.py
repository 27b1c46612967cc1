"""How the pool renders a ``train_dataset`` row into the prompt the workers sample from: GRPOTrainer's rendering
(``_tokenize_prompts``), once per row, with the checks that name the row when its prompt cannot be generated from.
A vision-language row also carries the processor's image inputs."""

from __future__ import annotations

import copy

from trl.data_utils import is_conversational

from ..records import PER_TOKEN_FIELDS
from ..rollout.images import prompt_with_images, row_images


def make_tokenize_row(p):
    """``tokenize_row(index, row) -> (prompt ids, image inputs)`` for the pool (``p``: its ``PoolInputs``)."""
    from transformers import ProcessorMixin

    tokenizer = copy.deepcopy(p.processing_class)
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
    is_vlm = isinstance(tokenizer, ProcessorMixin)
    chat_template, template_kwargs = p.chat_template, p.chat_template_kwargs
    tools = list(p.tools or []) or None  # as GRPOTrainer._tokenize_prompts renders them
    text_config = p.model.config.get_text_config()  # a vision-language model's language model
    limit = getattr(text_config, "max_position_embeddings", None)
    vocab = getattr(text_config, "vocab_size", None)
    completion = p.sampling.max_completion_length

    def tokenize_row(index: int, row: dict) -> tuple[tuple[int, ...], dict]:
        ids, images = _tokenize(row["prompt"], row_images(row))
        past = [t for t in ids if vocab is not None and t >= vocab]
        if past:
            raise ValueError(
                f"train_dataset row {index}: the prompt has token id {past[0]} "
                f"({text_tokenizer.convert_ids_to_tokens(past[0])!r}), past the model's vocabulary of {vocab}. "
                "Remove it from the data, or call model.resize_token_embeddings(len(tokenizer)) before building the "
                "trainer."
            )
        if limit is not None and len(ids) + completion > limit:
            # checked as each prompt is first used (tokenizing a whole dataset up front would be slow)
            raise ValueError(
                f"train_dataset row {index}: the prompt is {len(ids)} tokens, and with max_completion_length="
                f"{completion} that exceeds the model's max_position_embeddings={limit}. Filter long prompts "
                "out of the dataset or lower max_completion_length."
            )
        unsupported = sorted(set(images) - IMAGE_FIELDS - PER_TOKEN_FIELDS)
        if unsupported:
            raise ValueError(
                f"train_dataset row {index}: the processor gives {unsupported} beside the pixel values, which the "
                f"rollout workers do not batch (they take {sorted(IMAGE_FIELDS | PER_TOKEN_FIELDS)}). Use "
                "trl.GRPOTrainer for this model."
            )
        for key in PER_TOKEN_FIELDS & set(images):
            if images[key].size != len(ids):
                raise ValueError(
                    f"train_dataset row {index}: the processor's {key} has {images[key].size} entries for a prompt of "
                    f"{len(ids)} tokens; the rollout workers need one per prompt token. Use trl.GRPOTrainer for this "
                    "model."
                )
        return ids, images

    def _tokenize(prompt, images: list | None) -> tuple[tuple[int, ...], dict]:
        conversational = is_conversational({"prompt": prompt})
        if images is not None and not conversational:
            raise ValueError(MULTIMODAL_NEEDS_MESSAGES)
        if not conversational:
            return tuple(tokenizer(text=[prompt])["input_ids"][0]), {}
        if is_vlm:  # GRPOTrainer gives a VLM its messages as content parts, the row's images put in place
            prompt = prompt_with_images(prompt, images)
        out = tokenizer.apply_chat_template(
            conversation=[prompt],
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **({"return_tensors": "pt"} if is_vlm else {}),
            **template_kwargs,
        )
        # images (from the row or inside the messages): numpy arrays, pickled by value to the worker
        fields = {k: v.numpy() for k, v in out.items() if k not in ("input_ids", "attention_mask")} if is_vlm else {}
        return tuple(int(t) for t in out["input_ids"][0]), fields

    return tokenize_row


# the processor outputs the workers batch: one entry per image along the first dimension (LLaVA; LLaVA-NeXT's tiles,
# padded per batch; Qwen-VL's flattened patches with their grid), and one per prompt token (PER_TOKEN_FIELDS); fields
# padded per call in other ways (Idefics' pixel_attention_mask) are refused
IMAGE_FIELDS = {"pixel_values", "image_sizes", "image_grid_thw"}
MULTIMODAL_NEEDS_MESSAGES = (
    "a train_dataset row with images needs a conversational prompt (a list of messages), as GRPOTrainer requires: "
    "pass the raw messages and let the trainer apply the chat template"
)
