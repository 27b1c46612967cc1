"""The processed distribution, worked by hand on a 3-token vocabulary with probabilities (0.5, 0.3, 0.2)."""

import math

import pytest
import torch

from trl_async.correction.importance import off_policy_correction
from trl_async.correction.sampling import (
    SamplingSettings,
    context_ids,
    processed_logps,
    processors,
    sampled_before,
    settings_of,
    unreproduced_settings,
)

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.2]))
INF = math.inf


def logps_of(settings, tokens, prompt=(2,), logits=LOGITS):
    """log-prob of each of ``tokens`` as the completion's first token, after ``prompt``."""
    chain = processors(settings)
    return [
        processed_logps(logits.view(1, -1), torch.tensor(prompt), torch.tensor([token]), chain).item()
        for token in tokens
    ]


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, [0.5, 0.3, 0.2]),
        ({"top_p": 0.7}, [0.625, 0.375, 0.0]),  # ascending cumsum 0.2, 0.5, 1.0: the 0.2 (<= 1 - 0.7) goes
        ({"top_k": 1}, [1.0, 0.0, 0.0]),
        ({"min_p": 0.5}, [0.625, 0.375, 0.0]),  # below 0.5 x 0.5 = 0.25
        ({"temperature": 0.5}, [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),  # p^2 renormalised
        ({"temperature": 0.5, "top_p": 0.7}, [0.25 / 0.34, 0.09 / 0.34, 0.0]),  # 0.04/0.38 = 0.105 <= 0.3 goes
    ],
)
def test_each_truncation_renormalises_over_the_tokens_it_keeps(engine, fields, expected):
    got = logps_of(SamplingSettings(engine=engine, **fields), [0, 1, 2])
    assert got == pytest.approx([math.log(p) if p else -INF for p in expected], abs=1e-6)


def test_the_engines_order_min_p_and_top_p_differently():
    """min-p 0.5 and top-p 0.6. transformers: top-p first drops the 0.2, leaving (0.625, 0.375), which min-p (cut
    0.3125) keeps. vLLM: min-p first drops the 0.2, then top-p over (0.625, 0.375) drops the 0.375 (<= 0.4)."""
    fields = {"min_p": 0.5, "top_p": 0.6}
    assert logps_of(SamplingSettings(engine="transformers", **fields), [0, 1, 2]) == pytest.approx(
        [math.log(0.625), math.log(0.375), -INF]
    )
    assert logps_of(SamplingSettings(engine="vllm", **fields), [0, 1, 2]) == pytest.approx([0.0, -INF, -INF])


def test_the_repetition_penalty_sees_the_prompt_and_the_earlier_completion_tokens():
    """Penalty 2 on negative logits multiplies them by 2: a seen token's probability is squared before renormalising.
    Prompt (1,), completion (0, 0): token 0 first sees {1}: (0.5, 0.09, 0.2); then {1, 0}: (0.25, 0.09, 0.2)."""
    chain = processors(SamplingSettings(engine="vllm", repetition_penalty=2.0))
    got = processed_logps(LOGITS.expand(2, 3), torch.tensor([1]), torch.tensor([0, 0]), chain)
    assert got.tolist() == pytest.approx([math.log(0.5 / 0.79), math.log(0.25 / 0.54)], abs=1e-6)


def test_min_new_tokens_holds_the_stop_token_back_in_each_turn():
    """Stop token 0 (p 0.5) held back before 2 generated tokens: token 1 then has 0.3 / 0.5. In a second turn (after a
    tool-result token, not sampled) the count starts again."""
    settings = SamplingSettings(engine="transformers", min_new_tokens=2, stop_ids=(0,))
    chain = processors(settings)
    got = processed_logps(LOGITS.expand(3, 3), torch.tensor([2]), torch.tensor([1, 1, 0]), chain, settings)
    assert got.tolist() == pytest.approx([math.log(0.6), math.log(0.6), math.log(0.5)])
    assert sampled_before(torch.tensor([1, 1, 0, 1, 1, 1])).tolist() == [0, 1, 0, 0, 1, 2]
    # turn 1: (1); a tool token (2); turn 2: (1, 1, 0), whose counts are 0, 1, 2: the stop token only at the last
    turns = processed_logps(LOGITS.expand(5, 3), torch.tensor([2]), torch.tensor([1, 2, 1, 1, 0]), chain, settings,
                            torch.tensor([1, 0, 1, 1, 1]))  # fmt: skip
    assert [turns[i].item() for i in (0, 2, 3, 4)] == pytest.approx([math.log(0.6)] * 3 + [math.log(0.5)])
    hf = settings_of("transformers", {"min_new_tokens": 3, "eos_token_id": [5, 6]})
    assert (hf.min_new_tokens, hf.stop_ids, hf.reshapes) == (3, (5, 6), True)
    assert settings_of("vllm", {"min_tokens": 2, "stop_token_ids": [4]}).stop_ids == (4,)


def test_a_suppressed_token_is_never_sampled_and_the_rest_renormalise():
    """suppress_tokens (0,) removes p 0.5 at every step: token 1 then has 0.3 / 0.5, token 2 0.2 / 0.5, and top-k 1
    keeps token 1 alone. Only transformers' GenerationConfig has the field (GRPOTrainer sets it for a VLM's image
    token)."""
    settings = SamplingSettings(engine="transformers", suppressed=(0,))
    got = processed_logps(LOGITS.expand(3, 3), torch.tensor([2]), torch.tensor([1, 2, 0]), processors(settings),
                          settings)  # fmt: skip
    assert got.tolist() == pytest.approx([math.log(0.6), math.log(0.4), -INF])
    top1 = SamplingSettings(engine="transformers", top_k=1, suppressed=(0,))
    assert processed_logps(LOGITS[None], torch.tensor([2]), torch.tensor([1]), processors(top1), top1).item() == 0
    hf = settings_of("transformers", {"suppress_tokens": [7]})
    assert (hf.suppressed, hf.reshapes) == ((7,), True)
    assert settings_of("vllm", {"suppress_tokens": [7]}).suppressed == ()
    assert unreproduced_settings("transformers", {"suppress_tokens": [7]}) == []


def test_context_rows_hold_what_each_step_had_seen_and_an_id_past_the_vocabulary_elsewhere():
    got = context_ids(torch.tensor([7, 8]), torch.tensor([4, 5, 6]), vocab_size=9)
    assert got.tolist() == [[7, 8, 9, 9, 9], [7, 8, 4, 9, 9], [7, 8, 4, 5, 9]]


def test_the_ratio_at_staleness_0_is_one_with_the_processed_policy_and_the_kept_mass_without_it():
    """The same weights sampled token 0 under top-p 0.7: mu = log 0.625. Against the processed pi_prox the ratio is 1;
    against the full softmax (log 0.5) it is the kept mass 0.8, the bias a truncating sampler used to cause."""
    mu = torch.tensor([[math.log(0.625)]])
    processed = torch.tensor([logps_of(SamplingSettings(engine="vllm", top_p=0.7), [0])])
    mask = torch.ones(1, 1)
    assert off_policy_correction(processed, mu, mask, "decoupled", 2.0).stats["ratio_mean"] == pytest.approx(1.0)
    full = torch.tensor([[math.log(0.5)]])
    assert off_policy_correction(full, mu, mask, "decoupled", 2.0).stats["ratio_mean"] == pytest.approx(0.8)


def test_a_token_the_proximal_truncation_removes_gets_weight_zero():
    mu = torch.tensor([[math.log(0.2)]])  # sampled by a stale policy that kept it
    processed = torch.tensor([logps_of(SamplingSettings(engine="vllm", top_k=2), [2])])
    weights = off_policy_correction(processed, mu, torch.ones(1, 1), "decoupled", 2.0).weights_BT
    assert weights.item() == pytest.approx(0.0, abs=1e-8)


def test_settings_read_both_engines_conventions():
    vllm = settings_of(
        "vllm", {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    )
    assert vllm == SamplingSettings(engine="vllm", temperature=0.9) and not vllm.reshapes
    hf = settings_of("transformers", {"temperature": 1.0, "top_k": None, "top_p": 0.95, "min_p": None,
                                      "typical_p": 1.0, "epsilon_cutoff": 0.0, "top_h": None})  # fmt: skip
    assert hf == SamplingSettings(engine="transformers", top_p=0.95) and hf.reshapes
    assert settings_of("transformers", {"typical_p": 0.9}).extra_warpers == (("typical_p", 0.9),)
    assert SamplingSettings(engine="vllm", repetition_penalty=1.1).reshapes


def test_settings_not_rebuilt_are_named():
    assert unreproduced_settings("vllm", {"presence_penalty": 0.5, "seed": 3, "top_p": 0.9}) == ["presence_penalty"]
    assert unreproduced_settings("transformers", {"no_repeat_ngram_size": 3, "typical_p": 0.9}) == [
        "no_repeat_ngram_size"
    ]
    assert unreproduced_settings("vllm", {"typical_p": 0.9}) == ["typical_p"]  # not a vLLM sampling parameter
    assert unreproduced_settings("transformers", None) == []
