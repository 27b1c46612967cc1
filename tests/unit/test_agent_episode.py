"""An agent's requests as the sample it trains on (trl_async/agents/episode.py), worked out by hand."""

import pytest

from trl_async.agents.episode import Request, assemble, budget_left

pytestmark = pytest.mark.unit


def request(prompt, completion, version=0):
    return Request(tuple(prompt), tuple(completion), tuple(-0.5 - i for i in range(len(completion))),
                   (version,) * len(completion))  # fmt: skip


def test_requests_that_extend_each_other_are_one_sample_with_what_the_agent_added_masked():
    first = request([1, 2], [3, 4], version=5)
    second = request([1, 2, 3, 4, 9, 9], [6], version=6)  # the tool result (9, 9) in between
    third = request([1, 2, 3, 4, 9, 9, 6], [7, 8], version=7)  # nothing added: the same context continued
    sample = assemble([first, second, third])
    assert sample.prompt_ids == (1, 2) and sample.segments == 1
    assert sample.completion_ids == (3, 4, 9, 9, 6, 7, 8)
    assert sample.env_mask == (1, 1, 0, 0, 1, 1, 1)
    assert sample.logprobs == (-0.5, -1.5, 0.0, 0.0, -0.5, -0.5, -1.5)
    assert sample.versions == (5, 5, 5, 5, 6, 7, 7)  # an added token: the version of the sampled token before it


def test_a_rewritten_history_starts_a_segment_and_the_last_one_is_trained():
    first = request([1, 2], [3, 4])
    rewritten = request([1, 2, 3, 5, 9], [6])  # the template rendered token 4 as 5: not what was sampled
    last = request([1, 2, 3, 5, 9, 6, 9], [7])
    sample = assemble([first, rewritten, last])
    assert sample.segments == 2
    assert (sample.prompt_ids, sample.completion_ids, sample.env_mask) == ((1, 2, 3, 5, 9), (6, 9, 7), (1, 0, 1))
    shorter = request([1], [8])  # a prompt shorter than the sequence so far cannot extend it
    assert assemble([first, shorter]).segments == 2


def test_the_completion_budget_counts_sampled_and_added_tokens_of_the_current_segment():
    requests = [request([1, 2], [3, 4])]
    assert budget_left([], [1, 2], 10) == 10
    assert budget_left(requests, [1, 2, 3, 4, 9, 9], 10) == 6  # 4 tokens of completion so far
    assert budget_left(requests, [7, 7], 10) == 10  # a new segment
    with pytest.raises(ValueError, match="no request"):
        assemble([])
