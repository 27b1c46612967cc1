"""A dataset row's images, read and placed as GRPOTrainer reads and places them (its ``_generate_and_score_completions``
and ``_tokenize_prompts``): an ``images`` list or one ``image`` column, put into the conversational prompt's messages
as image parts; images already inside the messages count too."""

from __future__ import annotations

from trl.data_utils import prepare_multimodal_messages


def row_images(row: dict) -> list | None:
    """A row's image column: an ``images`` list, or one ``image`` (``None``: neither, or empty)."""
    if row.get("images"):
        return list(row["images"])
    if row.get("image") is not None:
        return [row["image"]]
    return None


def prompt_with_images(prompt, images: list | None):
    """The prompt a vision-language model is given: its messages as content parts, ``images`` put into the image
    placeholders (or before the first user message's text)."""
    return prepare_multimodal_messages(prompt, images=images)


def message_images(prompts: list) -> list | None:
    """Each prompt's images, taken from its messages' image parts (``None`` for a prompt without; ``None`` overall
    when no prompt has one)."""
    found = []
    for prompt in prompts:
        images = [
            part["image"]
            for message in prompt
            if isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None
        ]
        found.append(images or None)
    return found if any(found) else None
