"""How the pool renders a ``train_dataset`` row into the prompt the workers sample from: GRPOTrainer's rendering
(``_tokenize_prompts``), once per row, with the checks that name the row when its prompt cannot be generated from.
A vision-language row also carries the processor's image inputs."""

from __future__ import annotations

import copy

from trl.data_utils import is_conversational, prepare_multimodal_messages


def make_tokenize_row(p):
    """``tokenize_row(index, row) -> (prompt ids, image inputs)`` for the pool (``p``: its ``PoolInputs``)."""
    tokenizer = copy.deepcopy(p.processing_class)
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
                f"({tokenizer.convert_ids_to_tokens(past[0])!r}), past the model's vocabulary of {vocab}. Remove "
                "it from the data, or call model.resize_token_embeddings(len(tokenizer)) before building the "
                "trainer."
            )
        if limit is not None and len(ids) + completion > limit:
            # checked as each prompt is first used (tokenizing a whole dataset up front would be slow)
            raise ValueError(
                f"train_dataset row {index}: the prompt is {len(ids)} tokens, and with max_completion_length="
                f"{completion} that exceeds the model's max_position_embeddings={limit}. Filter long prompts "
                "out of the dataset or lower max_completion_length."
            )
        return ids, images

    def _tokenize(prompt, images: list | None) -> tuple[tuple[int, ...], dict]:
        if images is not None:  # as GRPOTrainer puts a row's images into its messages, and renders them
            if not is_conversational({"prompt": prompt}):
                raise ValueError(MULTIMODAL_NEEDS_MESSAGES)
            prompt = prepare_multimodal_messages(prompt, images=images)
        if is_conversational({"prompt": prompt}):
            out = tokenizer.apply_chat_template(
                conversation=[prompt],
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **({"return_tensors": "pt"} if images is not None else {}),
                **template_kwargs,
            )
            # numpy arrays: pickled by value to the worker (a torch tensor would travel as a shared-memory handle)
            fields = {k: v.numpy() for k, v in out.items() if k not in ("input_ids", "attention_mask")}
            return tuple(int(t) for t in out["input_ids"][0]), fields if images is not None else {}
        return tuple(tokenizer(text=[prompt])["input_ids"][0]), {}

    return tokenize_row


MULTIMODAL_NEEDS_MESSAGES = (
    "a train_dataset row with images needs a conversational prompt (a list of messages), as GRPOTrainer requires: "
    "pass the raw messages and let the trainer apply the chat template"
)


def row_images(row: dict) -> list | None:
    """A row's images as GRPOTrainer reads them (an ``images`` list, or one ``image``); ``None``: none."""
    if row.get("images"):
        return list(row["images"])
    if row.get("image") is not None:
        return [row["image"]]
    return None
