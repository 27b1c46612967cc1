"""A code task generated from a seed: write a small Python function, scored by running tests in the sandbox.

Each problem names a function and says what it does (string and list manipulation, arithmetic); its ``tests`` are
``assert`` statements on inputs drawn from the seed, comparing the ``repr`` of the result with that of a reference
implementation's (so a result object that claims to equal everything fails). The train
and held-out splits use disjoint sets of functions, so the held-out pass rate measures what carries over to functions
the policy never trained on. Score with ``trl_async.sandbox.rewards.CodeExecutionReward`` (the fraction of tests
passed); the generated code runs only inside the sandbox.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset

SYSTEM_PROMPT = "Write the Python function the user asks for. Reply with one ```python code block."
EXAMPLE = (
    {
        "role": "user",
        "content": "Write a Python function `negate_all(xs)` that returns a list with each number negated.",
    },
    {"role": "assistant", "content": "```python\ndef negate_all(xs):\n    return [-x for x in xs]\n```"},
)
TESTS_PER_PROBLEM = 4
WORDS = ("cat", "sun", "tree", "blue", "river", "apple", "stone", "light", "owl", "moon", "green", "cloud")


def _numbers(rng: random.Random) -> tuple:
    return ([rng.randint(-9, 20) for _ in range(rng.randint(1, 6))],)


def _text(rng: random.Random) -> tuple:
    return (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))),)


def _number(rng: random.Random) -> tuple:
    return (rng.randint(-50, 50),)


def _numbers_and_n(rng: random.Random) -> tuple:
    return _numbers(rng)[0], rng.randint(1, 5)


@dataclass(frozen=True)
class Function:
    """A function to write: its signature, what it does, a reference solution (one ``return`` expression of our
    own) and an input generator."""

    name: str
    params: str
    does: str
    body: str
    inputs: Callable[[random.Random], tuple]

    @property
    def solution(self) -> str:
        return f"def {self.name}({self.params}):\n    return {self.body}\n"

    def reference(self, *args):
        namespace: dict = {}
        exec(self.solution, namespace)  # our own reference source, never generated text
        return namespace[self.name](*args)


# each held-out function has a train function that teaches its skill (whisper/shout, reverse_words/reverse_list,
# initials/first_word, count_negative/count_positive), so the held-out pass rate can move; SmolLM2-135M-Instruct
# passes about two thirds of either set before training (greedy, float32)
TRAIN_FUNCTIONS = (
    Function("double_all", "xs", "returns a list with each number doubled", "[2 * x for x in xs]", _numbers),
    Function("add_n", "xs, n", "returns a list with n added to each number", "[x + n for x in xs]", _numbers_and_n),
    Function(
        "sum_even", "xs", "returns the sum of the even numbers in xs", "sum(x for x in xs if x % 2 == 0)", _numbers
    ),
    Function("count_words", "s", "returns the number of words in the string s", "len(s.split())", _text),
    Function("shout", "s", "returns s in upper case followed by '!'", "s.upper() + '!'", _text),
    Function("square", "x", "returns x times x", "x * x", _number),
    Function("largest", "xs", "returns the largest number in xs", "max(xs)", _numbers),
    Function("first_word", "s", "returns the first word of the string s", "s.split()[0]", _text),
    Function("last_word", "s", "returns the last word of the string s", "s.split()[-1]", _text),
    Function("reverse_list", "xs", "returns the list xs in reverse order", "xs[::-1]", _numbers),
    Function(
        "count_positive",
        "xs",
        "returns how many numbers in xs are greater than 0",
        "sum(1 for x in xs if x > 0)",
        _numbers,
    ),
    Function("dashed", "s", "returns the words of s joined by dashes", "'-'.join(s.split())", _text),
    Function(
        "word_lengths", "s", "returns a list of the lengths of the words in s", "[len(w) for w in s.split()]", _text
    ),
    Function("halve_all", "xs", "returns a list with each number divided by 2", "[x / 2 for x in xs]", _numbers),
)
HELDOUT_FUNCTIONS = (
    Function("triple_all", "xs", "returns a list with each number tripled", "[3 * x for x in xs]", _numbers),
    Function("smallest", "xs", "returns the smallest number in xs", "min(xs)", _numbers),
    Function("whisper", "s", "returns s in lower case followed by '...'", "s.lower() + '...'", _text),
    Function("cube", "x", "returns x times x times x", "x * x * x", _number),
    Function(
        "reverse_words",
        "s",
        "returns the words of s in reverse order, joined by spaces",
        "' '.join(s.split()[::-1])",
        _text,
    ),
    Function(
        "count_negative",
        "xs",
        "returns how many numbers in xs are less than 0",
        "sum(1 for x in xs if x < 0)",
        _numbers,
    ),
    Function(
        "initials",
        "s",
        "returns the first letter of each word of s, joined into one string",
        "''.join(w[0] for w in s.split())",
        _text,
    ),
    Function("ends_with_e", "s", "returns True if s ends with the letter e, else False", "s.endswith('e')", _text),
)


def make_problem(rng: random.Random, fn: Function) -> dict:
    tests = []
    for _ in range(TESTS_PER_PROBLEM):
        args = fn.inputs(rng)
        call = f"{fn.name}({', '.join(map(repr, args))})"
        tests.append(
            f"assert repr({call}) == {repr(fn.reference(*args))!r}"
        )  # repr: an object equal to everything fails
    ask = f"Write a Python function `{fn.name}({fn.params})` that {fn.does}."
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": ask}],
        "tests": tests,
    }


def make_split(split: str, n: int, seed: int = 0) -> Dataset:
    """``n`` problems from the ``"train"`` or ``"heldout"`` functions, cycling through them; the same ``seed`` gives
    the same problems."""
    functions = {"train": TRAIN_FUNCTIONS, "heldout": HELDOUT_FUNCTIONS}.get(split)
    if functions is None:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"code-{split}-{seed}")
    return Dataset.from_list([make_problem(rng, functions[i % len(functions)]) for i in range(n)])
