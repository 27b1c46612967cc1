"""An agent written against the official ``openai`` client (the docs' example, examples/agent_openai.py), trained
through the endpoint (trl_async/agents): real tool calls over several turns from the tiny tool model
(tests/tool_model.py), on real rollout workers. What is trained
is exactly what was sampled; the prompts are the chat template's; at staleness 0 every ratio is 1. Agents that raise,
hang, send malformed requests or flood the endpoint end their group (counted) and training goes on."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from openai import OpenAI

from examples.agent_openai import TOOLS, agent
from trl_async import AsyncGRPOTrainer
from trl_async.agents import agent_reward, agent_rollout
from trl_async.agents.episode import assemble

from ..conftest import async_args, no_rollout_children
from .test_tools import TOOL_SETTINGS, dataset, tokenizer_of

PROMPTS = ["What is 3 times 4?", "What is 5 times 6?", "Say hello.", "What is 7 times 7?"]


def test_an_openai_client_agent_trains_on_exactly_the_tokens_it_sampled(tmp_path, tool_model_dir):
    tokenizer = tokenizer_of(tool_model_dir)
    rollout = agent_rollout(agent, timeout_s=120)  # the docs' example agent (examples/agent_openai.py)
    settings = {**TOOL_SETTINGS, "per_device_train_batch_size": 8, "max_steps": 2}
    args = async_args(tmp_path, **settings, max_staleness=0, rollout_trajectory_file="traj.jsonl")
    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=agent_reward, processing_class=tokenizer,
                               args=args, train_dataset=dataset(PROMPTS), rollout_func=rollout)  # fmt: skip
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 8
    episodes = list(rollout.episodes)
    samples = [assemble(requests) for requests in episodes if requests]  # (a group cut short at the end: none)

    def recorded(row, sample) -> bool:
        return (
            list(sample.prompt_ids),
            list(sample.completion_ids),
            list(sample.env_mask),
            list(sample.versions),
        ) == (row["prompt_ids"], row["completion_ids"], row["tool_mask"], row["versions"]) and [
            lp for lp, m in zip(row["logprobs"], row["tool_mask"], strict=True) if m
        ] == pytest.approx([lp for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m])

    for row in rows:  # every trained row is an episode's sample: sampled tokens (mask 1) with their own mu
        assert any(recorded(row, sample) for sample in samples), row
    # several turns happened, and extended each other: tool results are masked inside one sample
    multi_turn = [s for s in samples if len(s.env_mask) > sum(s.env_mask)]
    assert multi_turn and all(s.segments == 1 for s in multi_turn)
    for requests in filter(
        None, episodes
    ):  # the first prompt is the chat template's rendering of the row, with the tool schema
        first = requests[0].prompt_ids
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=TOOLS,
                                                  add_generation_prompt=True, tokenize=True)["input_ids"]
                    for p in PROMPTS]  # fmt: skip
        assert list(first) in rendered
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert len(logs) == 2
    for h in logs:  # mu of every sampled token is the trainer's teacher-forced probability at the same version
        assert abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3, h
    assert no_rollout_children()
    rollout.close()


def failing(prompt, base_url: str) -> float:
    """ "Say hello." raises; "What is 5 times 6?" hangs past the timeout; "What is 7 times 7?" floods; the rest work."""
    text = prompt[-1]["content"]
    if text == "Say hello.":
        raise RuntimeError("the agent's own bug")
    if text == "What is 5 times 6?":
        time.sleep(30)
    requests = 5 if text == "What is 7 times 7?" else 1
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    for _ in range(requests):
        try:
            client.chat.completions.create(model="policy", messages=list(prompt), max_tokens=4)
        except Exception:  # noqa: BLE001 - a flooding agent ignores its errors
            pass
    return 1.0


def test_agents_that_raise_hang_or_flood_end_their_group_and_training_goes_on(tmp_path, tool_model_dir):
    rollout = agent_rollout(failing, timeout_s=3, max_requests=3)
    settings = {**TOOL_SETTINGS, "per_device_train_batch_size": 2, "max_steps": 2}
    prompts = ["Say hello.", "What is 5 times 6?", "What is 7 times 7?", "What is 3 times 4?"]
    trainer = AsyncGRPOTrainer(model=tool_model_dir, reward_funcs=agent_reward,
                               processing_class=tokenizer_of(tool_model_dir), args=async_args(tmp_path, **settings),
                               train_dataset=dataset(prompts * 3), rollout_func=rollout)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    abandoned = [h["async/abandoned_groups"] for h in trainer.state.log_history if "async/abandoned_groups" in h]
    assert abandoned and abandoned[-1] >= 3  # one of each failure at least, before two groups of the good prompt
    rollout.close()


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_many_agents_connecting_at_once_are_all_served():
    """32 episodes at once, 5 requests each, through the openai client: every request answered (a small listen
    backlog resets connections under such a burst)."""
    from trl_async.agents.endpoint import Endpoint
    from trl_async.demo.tiny import build_char_tokenizer

    endpoint, errors = Endpoint(), []

    def generate(contexts, max_new_tokens=None):
        time.sleep(0.02)
        return {"completion_ids": [[5, 6, 1]], "logprobs": [[-0.1, -0.2, -0.3]], "versions": [[0, 0, 0]]}

    def run():
        _, url = endpoint.open(generate=generate, tokenizer=build_char_tokenizer(), chat_template=None,
                               chat_template_kwargs={}, max_completion_length=64, max_requests=8)  # fmt: skip
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        try:
            for k in range(5):
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi" * (k + 1)}])
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(f"{exc!r} ({exc.__cause__!r})")

    threads = [threading.Thread(target=run) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    endpoint.close()
    assert errors == []


def test_malformed_requests_get_an_openai_error_naming_the_problem(tool_model_dir):
    from trl_async.agents.endpoint import Endpoint

    endpoint = Endpoint()
    sampled = []

    def generate(contexts, max_new_tokens=None):
        sampled.append((contexts, max_new_tokens))
        return {"completion_ids": [[5, 6]], "logprobs": [[-0.1, -0.2]], "versions": [[0, 0]]}

    episode, url = endpoint.open(generate=generate, tokenizer=tokenizer_of(tool_model_dir), chat_template=None,
                                 chat_template_kwargs={}, max_completion_length=8, max_requests=2)  # fmt: skip
    hello = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", 400, "not JSON"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty list"),
        (json.dumps({"messages": hello, "stream": True}).encode(), 400, "stream"),
        (json.dumps({"messages": hello, "n": 2}).encode(), 400, "n=2"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": hello, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400, "text"),
    ]
    for body, status, says in cases:
        code, reply = post(f"{url}/chat/completions", body)
        assert (code, says in reply["error"]["message"]) == (status, True), (body, reply)
    assert sampled == [] and episode.requests == []  # nothing malformed reached the workers
    ok = json.dumps({"messages": hello, "max_tokens": 3}).encode()
    assert post(f"{url}/chat/completions", ok)[0] == 200 and sampled[-1][1] == 3  # the request's cap applies
    assert post(f"{url}/chat/completions", ok)[0] == 200
    code, reply = post(f"{url}/chat/completions", ok)  # a third request: past max_requests
    assert code == 429 and episode.refused is not None and len(episode.requests) == 2
    endpoint.close_episode(episode)
    assert post(f"{url}/chat/completions", ok)[0] == 404  # an ended episode's URL answers no more
    assert post(f"{endpoint.url}/episodes/guess/v1/chat/completions", ok)[0] == 404
    endpoint.close()
    assert not [t for t in threading.enumerate() if t.name == "trl_async-agent-endpoint"]


def test_stop_strings_and_the_sample_budget_keep_only_sampled_tokens():
    """A stop string cuts the completion after the token that completes it (the kept tokens with their own mu); a
    request past max_completion_length gets an empty "length" reply and records nothing."""
    from trl_async.agents.endpoint import Endpoint
    from trl_async.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    sampled = tokenizer.convert_tokens_to_ids(list("ab.cd"))
    endpoint = Endpoint()

    def generate(contexts, max_new_tokens=None):
        n = min(len(sampled), max_new_tokens)
        return {"completion_ids": [sampled[:n]], "logprobs": [[-0.5] * n], "versions": [[3] * n]}

    episode, url = endpoint.open(generate=generate, tokenizer=tokenizer, chat_template=None, chat_template_kwargs={},
                                 max_completion_length=12, max_requests=8)  # fmt: skip
    user = [{"role": "user", "content": "q"}]
    code, reply = post(f"{url}/chat/completions", json.dumps({"messages": user, "stop": ".", "n": None}).encode())
    assert code == 200 and reply["choices"][0]["message"]["content"] == "ab"
    assert reply["choices"][0]["finish_reason"] == "stop" and episode.requests[0].completion_ids == tuple(sampled[:3])
    long = [*user, {"role": "assistant", "content": "ab."}, {"role": "user", "content": "x" * 20}]
    code, reply = post(f"{url}/chat/completions", json.dumps({"messages": long}).encode())
    assert (code, reply["choices"][0]["finish_reason"], len(episode.requests)) == (200, "length", 1)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]  # a dict: accepted
    code, _ = post(f"{url}/chat/completions", json.dumps({"messages": [*user, {"role": "assistant", "content": None,
                                                         "tool_calls": calls}]}).encode())  # fmt: skip
    assert code == 200
    assert post(f"{url}/chat/completions", b"\xff\xfe")[0] == 400  # not UTF-8
    endpoint.close()
