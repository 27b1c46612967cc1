import asyncio
import math

import pytest
import torch

from trl_async.demo.tiny import build_char_tokenizer
from trl_async.rollout.scoring import RewardFunctionError, RewardScorer, decode_completions


def make_scorer(*funcs):
    names = [f.__name__ for f in funcs]
    return RewardScorer(funcs, [None] * len(funcs), names, {}, torch.device("cpu"), trainer_state=lambda: "STATE")


def test_sync_async_and_none_rewards_with_dataset_columns_and_logging():
    def sync_reward(prompts, completions, answer, trainer_state, log_metric, log_extra, **kwargs):
        assert trainer_state == "STATE"
        log_metric("my/metric", 3.0)
        log_extra("judge", ["ok"] * len(completions))
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    async def async_reward(completions, **kwargs):
        return [len(c) for c in completions]

    def sometimes_none(completions, **kwargs):
        return [None, 1.0]

    rows = [{"prompt": "p", "answer": "x"}, {"prompt": "p", "answer": "y"}]
    rewards, extra, metrics = make_scorer(sync_reward, async_reward, sometimes_none).score(
        rows, ["x", "zz"], [[1], [2]]
    )
    assert rewards[:, 0].tolist() == [1.0, 0.0] and rewards[:, 1].tolist() == [1.0, 2.0]
    assert math.isnan(rewards[0, 2]) and rewards[1, 2] == 1.0  # None -> NaN, as GRPOTrainer does
    assert metrics == {"my/metric": [3.0]} and extra == {"judge": ["ok", "ok"]}


def test_a_row_every_function_scored_none_is_warned_about_as_grpo_trainer_does(caplog):
    def none_for_the_first(completions, **kwargs):
        return [None, 1.0]

    def none_for_the_second(completions, **kwargs):
        return [1.0, None]

    def always_none(completions, **kwargs):
        return [None] * len(completions)

    rows = [{"prompt": "p0", "answer": "a0"}, {"prompt": "p1", "answer": "a1"}]
    with caplog.at_level("WARNING"):
        make_scorer(none_for_the_first, none_for_the_second).score(rows, ["x", "y"], [[1], [2]])
    assert "All reward functions returned None" not in caplog.text  # every row has a value from some function
    with caplog.at_level("WARNING"):
        make_scorer(none_for_the_first, always_none).score(rows, ["x", "y"], [[1], [2]])
    warned = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warned) == 1  # GRPOTrainer's words, and the first such row's inputs
    assert warned[0].startswith("All reward functions returned None for the following kwargs:")
    assert "'answer': 'a0'" in warned[0] and "'prompt': 'p0'" in warned[0] and "'completion': 'x'" in warned[0]


def test_raising_reward_names_the_function_and_shows_the_input():
    def fragile(completions, **kwargs):
        raise KeyError("boom")

    with pytest.raises(
        RewardFunctionError, match=r"(?s)'fragile' raised KeyError.*prompt 'the prompt'.*'the completion'"
    ):
        make_scorer(fragile).score([{"prompt": "the prompt"}], ["the completion"], [[1]])


def test_wrong_number_of_rewards_is_an_error():
    with pytest.raises(RewardFunctionError, match="returned 1 rewards, but 2 were expected"):
        make_scorer(lambda completions, **kw: [1.0]).score([{"prompt": "a"}] * 2, ["x", "y"], [[1], [2]])


def test_decode_matches_grpo_text_and_chat_formats():
    tok = build_char_tokenizer()
    ids = [tok("ab")["input_ids"] + [tok.eos_token_id]]
    assert decode_completions(tok, [[5]], ids, conversational=False) == ["ab"]
    assert decode_completions(tok, [[5]], ids, conversational=True) == [[{"role": "assistant", "content": "ab"}]]


GATE = None  # module-level, loop-bound state as users write it (an asyncio.Semaphore, an async HTTP client)


@pytest.mark.unit
def test_async_rewards_share_one_event_loop_across_groups():
    """GRPOTrainer runs async rewards on one long-lived loop; a semaphore shared by calls binds to the loop it first
    waits on, so a new loop per group raises 'bound to a different event loop' on the second group."""
    global GATE
    GATE = asyncio.Semaphore(1)
    loops = set()

    async def limited(completions, **kwargs):
        loops.add(id(asyncio.get_running_loop()))

        async def one(c):
            async with GATE:  # two waiters: the semaphore binds to this loop
                await asyncio.sleep(0)
                return float(len(c))

        return await asyncio.gather(*(one(c) for c in completions))

    scorer = make_scorer(limited)
    try:
        for _ in range(5):
            rewards, _, _ = scorer.score([{"prompt": "p"}] * 2, ["x", "yy"], [[1], [2]])
            assert rewards[:, 0].tolist() == [1.0, 2.0]
    finally:
        scorer.close()
    assert len(loops) == 1


@pytest.mark.unit
def test_scorer_uses_a_given_loop_and_does_not_close_it():
    from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon(name="test-loop")
    ready.wait()
    seen = []

    async def where(completions, **kwargs):
        seen.append(asyncio.get_running_loop())
        return [1.0] * len(completions)

    scorer = RewardScorer([where], [None], ["where"], {}, torch.device("cpu"), lambda: None, event_loop=loop)
    scorer.score([{"prompt": "p"}], ["x"], [[1]])
    scorer.close()
    assert seen == [loop] and loop.is_running()  # the trainer's loop: used, and left running for the trainer
    shutdown_event_loop_in_daemon(thread, loop)


@pytest.mark.unit
def test_async_rewards_of_a_group_run_concurrently_as_grpo_trainer_gathers_them():
    """Two async judges that each wait for the other to start: only concurrent awaiting finishes (one after the other,
    the first waits 2 s for the second and fails)."""
    started = {"a": None, "b": None}

    async def judge(me, other, completions):
        started[me] = started[me] or asyncio.Event()
        started[other] = started[other] or asyncio.Event()
        started[me].set()
        await asyncio.wait_for(started[other].wait(), timeout=2)
        return [1.0] * len(completions)

    async def judge_a(completions, **kwargs):
        return await judge("a", "b", completions)

    async def judge_b(completions, **kwargs):
        return await judge("b", "a", completions)

    scorer = make_scorer(judge_a, judge_b)
    try:
        rewards, _, _ = scorer.score([{"prompt": "p"}] * 2, ["x", "y"], [[1], [2]])
    finally:
        scorer.close()
    assert rewards.tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.unit
def test_a_raising_async_reward_is_named():
    async def flaky(completions, **kwargs):
        raise ConnectionError("judge unreachable")

    scorer = make_scorer(flaky)
    try:
        with pytest.raises(RewardFunctionError, match=r"'flaky' raised ConnectionError: judge unreachable"):
            scorer.score([{"prompt": "p"}], ["x"], [[1]])
    finally:
        scorer.close()
