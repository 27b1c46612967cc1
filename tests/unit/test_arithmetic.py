"""The arithmetic word-problem task: splits, answers and the two string-parsing rewards (worked out by hand)."""

import pytest

from trl_async.demo.arithmetic import (
    HELDOUT_TEMPLATES,
    TRAIN_TEMPLATES,
    correctness_reward,
    final_answer,
    format_reward,
    make_split,
)


def _question(row) -> str:
    return row["prompt"][-1]["content"]


def test_splits_are_reproducible_and_use_disjoint_templates():
    a, b = make_split("train", 24, seed=3), make_split("train", 24, seed=3)
    assert a.to_list() == b.to_list()
    assert make_split("train", 24, seed=4).to_list() != a.to_list()
    assert {t.text for t in TRAIN_TEMPLATES}.isdisjoint({t.text for t in HELDOUT_TEMPLATES})
    # every held-out question comes from a held-out template: its fixed words are in it, and in no train template
    held = make_split("heldout", 8, seed=0)
    for i, row in enumerate(held):
        template = HELDOUT_TEMPLATES[i % len(HELDOUT_TEMPLATES)]
        anchor = template.text.split("{")[1].split("}")[1].strip().split(" ")[0]  # first fixed word after a slot
        assert anchor in _question(row)


def test_answers_follow_the_story():
    # "{name} has {a} {item} and buys {b} more" -> a + b; parse a and b back out of the question
    row = make_split("train", 6, seed=0)[0]
    words = _question(row).split()
    a, b = int(words[2]), int(words[6])
    assert row["answer"] == str(a + b)
    for row in make_split("heldout", 40, seed=1):
        assert int(row["answer"]) > 0  # no negative counts


def test_prompt_is_a_conversation_ending_with_the_question():
    row = make_split("heldout", 1)[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user"]


def test_bad_split_name():
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        make_split("test", 4)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4 + 3 = 7\nAnswer: 7", 7.0),
        ("so 3 + 4 = 7. The answer is 8.", 8.0),
        ("Answer: **12**", 12.0),
        ("I had 5 and 2 left", 2.0),  # no stated answer: the last number
        ("no numbers here", None),
        ("Answer: -3", -3.0),
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_rewards_parse_plain_and_conversational_completions():
    completions = ["12 - 5 = 7\nAnswer: 7", [{"role": "assistant", "content": "The answer is 9"}], "7 apples", "x"]
    assert correctness_reward(completions, answer=["7", "8", "7", "1"]) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0]
