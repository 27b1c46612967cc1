"""A verifiable task generated from a seed: arithmetic word problems, with a held-out split of different templates.

Each problem is a short story with one or two operations on small whole numbers ("Tom has 3 apples and buys 5
more..."). The train split and the held-out split use disjoint sets of story templates, so held-out accuracy measures
whether what the policy learned carries over to phrasings it never trained on, not whether it memorised some.

Rewards are pure string parsing (a regular expression finds the numbers); nothing generated is executed or evaluated:
- ``correctness_reward``: 1.0 when the completion's final answer equals the problem's answer, else 0.0.
- ``format_reward``: 1.0 when the completion states its answer (``Answer: <number>`` or ``the answer is <number>``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset

SYSTEM_PROMPT = "Solve the problem. Write the calculation, then 'Answer: <number>'."
# one worked example as chat turns: without it the model almost never states an answer in a parseable form (format
# reward 0 in 48 samples); with it, about a quarter of samples do (measured, README of benchmarks/)
EXAMPLE = (
    {"role": "user", "content": "Sara has 4 pens and buys 3 more. How many pens does Sara have now?"},
    {"role": "assistant", "content": "4 + 3 = 7\nAnswer: 7"},
)

# GRPO settings for this task on SmolLM2-135M-Instruct, chosen by measurement (README, "A real model, offline"); the
# CPU demo and benchmarks/time_to_accuracy.py train with them
TRAINING_SETTINGS = dict(
    learning_rate=2e-5,
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=32,
    temperature=0.7,
    beta=0.0,
)

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Zoe", "Leo", "Emma", "Jack", "Nora")
ITEMS = ("apples", "pencils", "books", "stickers", "cookies", "marbles", "cards", "balloons", "coins", "shells")


@dataclass(frozen=True)
class Template:
    """A story with slots {name} {item} {a} {b} [{c}] and the answer as a function of the numbers."""

    text: str
    answer: Callable[[int, int, int], int]


TRAIN_TEMPLATES = (
    Template("{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", lambda a, b, c: a + b),
    Template("{name} had {a} {item} and gave {b} away. How many {item} are left?", lambda a, b, c: a - b),
    Template(
        "There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?",
        lambda a, b, c: a + b,
    ),
    Template("{name} found {a} {item}, then lost {b}. How many {item} does {name} have?", lambda a, b, c: a - b),
    Template(
        "{name} has {a} {item}, buys {b} more, then gives away {c}. How many {item} does {name} have?",
        lambda a, b, c: a + b - c,
    ),
    Template(
        "A shelf holds {a} {item}. {name} adds {b} and later removes {c}. How many {item} are on the shelf?",
        lambda a, b, c: a + b - c,
    ),
)
HELDOUT_TEMPLATES = (
    Template(
        "{name} collected {a} {item} on Monday and {b} on Tuesday. How many {item} in total?", lambda a, b, c: a + b
    ),
    Template("{name} started with {a} {item}. After eating {b}, how many {item} remain?", lambda a, b, c: a - b),
    Template(
        "{name} owns {a} {item}. A friend gives {name} {b} more, and {name} sells {c}. How many {item} now?",
        lambda a, b, c: a + b - c,
    ),
    Template(
        "A bag has {a} {item}. {b} more are added. What is the number of {item} in the bag?", lambda a, b, c: a + b
    ),
)


def make_problem(rng: random.Random, template: Template) -> dict:
    a = rng.randint(3, 20)
    b = rng.randint(1, a - 1)  # a - b > 0
    c = rng.randint(1, a + b - 1)  # a + b - c > 0
    question = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, c=c)
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": question}],
        "answer": str(template.answer(a, b, c)),
    }


def make_split(split: str, n: int, seed: int = 0) -> Dataset:
    """``n`` problems from the ``"train"`` or ``"heldout"`` templates, cycling through the templates so every
    template is equally represented; the same ``seed`` gives the same problems."""
    templates = {"train": TRAIN_TEMPLATES, "heldout": HELDOUT_TEMPLATES}.get(split)
    if templates is None:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    return Dataset.from_list([make_problem(rng, templates[i % len(templates)]) for i in range(n)])


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer(?::| is:?)\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion  # conversational or plain


def final_answer(text: str) -> float | None:
    """The number of the last stated answer ('Answer: 7', 'the answer is 7'), else the last number, else None."""
    stated = _ANSWER.findall(text)
    numbers = stated or _NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference, else 0.0."""
    return [
        1.0 if (got := final_answer(_text(c))) is not None and got == float(ref) else 0.0
        for c, ref in zip(completions, answer, strict=True)
    ]


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion states its answer ('Answer: <number>' or 'the answer is <number>'), else 0.0."""
    return [1.0 if _ANSWER.search(_text(c)) else 0.0 for c in completions]
