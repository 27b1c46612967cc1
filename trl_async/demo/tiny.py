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
    max_position_embeddings: int = 256,
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
        max_position_embeddings=max_position_embeddings,
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


# ---- a tiny tool-calling model (multi-turn tests and the agentic benchmark) ----------------------------------------
TOOL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<unk>",
]


def build_tool_tokenizer(corpus: list[str], vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """A BPE tokenizer with Qwen3's chat template and special tokens, trained on ``corpus`` (rendered conversations):
    TRL recognises the template (``add_response_schema``), so tool calls are parsed as they are for Qwen3, and the
    long tool-schema boilerplate of the system prompt compresses into a few tokens. No pre-tokenizer: merges may
    span spaces, and decoding is exact concatenation."""
    from tokenizers import trainers
    from trl.chat_template_utils import qwen3_chat_template

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TOOL_SPECIAL_TOKENS,
        initial_alphabet=list(string.printable),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=TOOL_SPECIAL_TOKENS[3:9],
        padding_side="left",
    )
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def render_text(conversation: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    """``conversation`` rendered with TRL's training variant of the Qwen3 template (the one GRPOTrainer renders
    tool-calling prompts with), as text."""
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    renderer = build_char_tokenizer()
    renderer.chat_template = qwen3_chat_template
    template = get_training_chat_template(renderer) or qwen3_chat_template
    return renderer.apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def fit_sequences(
    model, sequences: list[tuple[list[int], list[int]]], steps: int = 300, lr: float = 3e-3, seed: int = 0
) -> float:
    """Teach ``model`` to continue each ``(context, target)`` with ``target`` (cross-entropy on the target tokens
    only; full batch, Adam). Returns the final loss. A few hundred steps make a tiny model's greedy output the
    targets, so tests can drive real tool calls through real worker processes."""
    import torch

    torch.manual_seed(seed)
    width = max(len(c) + len(t) for c, t in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, (context, target) in enumerate(sequences):
        row = context + target
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(context) : len(row)] = torch.tensor(target)
        mask[i, : len(row)] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss)


def build_tool_model(
    path: str | Path,
    episodes: dict[str, list[tuple[str, list[str]]]],
    tools: list,
    fit_steps: int = 400,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
) -> Path:
    """Save a tiny tool-calling model under ``path`` whose turns follow ``episodes``: for each user prompt, a list
    of ``(assistant turn text, tool results after it)``; the model is fitted to say turn ``r + 1`` after turn ``r``
    followed by any of those results (the last turn has none). A turn that is a call is written as
    ``<tool_call>\n{json}\n</tool_call>``. Prompts render with ``tools`` in the system prompt (Qwen3 template, TRL's
    training variant), exactly as GRPOTrainer renders them. Load the tokenizer with ``PreTrainedTokenizerFast``:
    transformers 5 loads a Qwen2 model's tokenizer as ``Qwen2Tokenizer``, which replaces the saved pre-tokenizer."""
    import json

    from trl.chat_template_utils import get_training_chat_template

    from ..rollout.grpo_private import ToolSuffix

    def tool_name(turn: str) -> str:
        try:
            return json.loads(turn.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0])["name"]
        except (IndexError, ValueError, KeyError, TypeError):
            return tools[0].__name__

    def histories(turns):  # every (messages so far, next turn) the model must learn
        states = [([], 0)]
        while states:
            messages, r = states.pop()
            text, results = turns[r]
            yield messages, text
            for result in results if r + 1 < len(turns) else []:
                tool = {"role": "tool", "name": tool_name(text), "content": result}
                states.append((messages + [{"role": "assistant", "content": text}, tool], r + 1))

    path = Path(path)
    user = {prompt: [{"role": "user", "content": prompt}] for prompt in episodes}
    corpus = [
        render_text(user[p] + m, tools, add_generation_prompt=True) + t + "<|im_end|>"
        for p, turns in episodes.items()
        for m, t in histories(turns)
    ]
    tokenizer = build_tool_tokenizer(corpus)
    template = get_training_chat_template(tokenizer)
    suffix = ToolSuffix(tokenizer, template, {})
    sequences = []
    for prompt, turns in episodes.items():
        context = list(
            tokenizer.apply_chat_template(
                user[prompt],
                tools=tools,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for messages, text in histories(turns):
            ids = list(context)
            for i in range(0, len(messages), 2):  # (assistant turn, tool result) pairs, as the trainer splices them
                ids += tokenizer.encode(messages[i]["content"] + "<|im_end|>", add_special_tokens=False)
                ids += suffix.ids([messages[i + 1]])
            sequences.append((ids, tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)))
    longest = max(len(c) + len(t) for c, t in sequences)
    model = build_tiny_model(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_position_embeddings=4 * longest,
    )
    loss = fit_sequences(model, sequences, steps=fit_steps)
    if loss > 0.05:
        raise RuntimeError(f"the tiny tool-calling model did not fit its turns (loss {loss:.3f})")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
