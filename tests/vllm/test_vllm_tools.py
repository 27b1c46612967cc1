"""Multi-turn episodes on the vLLM backend: `tools` and `environment_factory` with a real vLLM CPU server serving the
tiny tool-calling model (tests/tool_model.py), checked against TRL's GRPOTrainer on the same model, as
tests/integration/test_tools.py and tests/integration/test_environments.py check the transformers workers."""

from __future__ import annotations

import json

import pytest
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, no_rollout_children
from ..integration.test_environments import Multiplier, rows
from ..integration.test_tools import TOOL_SETTINGS, TRL_PROMPTS, Recorder, dataset, tokenizer_of, tool_metrics
from ..tool_model import TOOL_RESULTS, multiply


def _by_prompt(seen):
    return {p[-1]["content"]: c for ps, cs in seen for p, c in zip(ps, cs, strict=True)}


def _vllm(tmp_path, url, **overrides):
    # max_staleness=0: each step trains on one generation batch's groups, as GRPOTrainer does
    return async_args(tmp_path, **TOOL_SETTINGS, max_staleness=0, rollout_backend="vllm", rollout_vllm_urls=[url],
                      vllm_server_timeout=30, rollout_trajectory_file="traj.jsonl", **overrides)  # fmt: skip


def test_trl_tool_scenarios_on_the_vllm_backend_give_grpo_trainers_metrics_and_messages(
    tmp_path, vllm_tool_server, vllm_tool_model_dir
):
    reference = Recorder()
    sync = GRPOTrainer(model=vllm_tool_model_dir, reward_funcs=reference,
                       processing_class=tokenizer_of(vllm_tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **TOOL_SETTINGS),
                       train_dataset=dataset(TRL_PROMPTS), tools=[multiply])  # fmt: skip
    sync.train()
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(model=vllm_tool_model_dir, reward_funcs=recorder,
                               processing_class=tokenizer_of(vllm_tool_model_dir),
                               args=_vllm(tmp_path / "async", vllm_tool_server.url),
                               train_dataset=dataset(TRL_PROMPTS), tools=[multiply])  # fmt: skip
    trainer.train()
    assert tool_metrics(sync) == [(pytest.approx(2 / 3), 0.5)] * 2
    assert tool_metrics(trainer) == tool_metrics(sync)
    ours, theirs = _by_prompt(recorder.seen), _by_prompt(reference.seen)
    assert set(ours) == set(TRL_PROMPTS) and all(ours[p] == theirs[p] for p in TRL_PROMPTS)
    assert ours["What is 5 times 6?"][1]["content"] == TOOL_RESULTS["What is 5 times 6?"]
    # the server sampled both turns of an episode; the tool's tokens are masked and every token has a version
    records = [json.loads(x) for x in (tmp_path / "async" / "traj.jsonl").read_text().splitlines()]
    called = [r for r in records if len(r["turns"]) == 2]
    assert called and all(0 in r["tool_mask"] and r["tool_mask"][-1] == 1 for r in called)
    assert all(len(r["versions"]) == len(r["completion_ids"]) and r["staleness"] == 0 for r in records)
    assert no_rollout_children()


def test_environments_on_the_vllm_backend_give_grpo_trainers_rewards(tmp_path, vllm_tool_server, vllm_tool_model_dir):
    reference = Recorder()
    sync = GRPOTrainer(model=vllm_tool_model_dir, reward_funcs=reference,
                       processing_class=tokenizer_of(vllm_tool_model_dir),
                       args=GRPOConfig(output_dir=str(tmp_path / "sync"), **TOOL_SETTINGS),
                       train_dataset=rows(), environment_factory=Multiplier)  # fmt: skip
    sync.train()
    recorder = Recorder()
    ours = AsyncGRPOTrainer(model=vllm_tool_model_dir, reward_funcs=recorder,
                            processing_class=tokenizer_of(vllm_tool_model_dir),
                            args=_vllm(tmp_path / "async", vllm_tool_server.url),
                            train_dataset=rows(), environment_factory=Multiplier)  # fmt: skip
    ours.train()

    def env_rewards(t):
        return [h["rewards/Multiplier/mean"] for h in t.state.log_history if "rewards/Multiplier/mean" in h]

    assert env_rewards(ours) == env_rewards(sync) == [pytest.approx(1 / 3)] * 2
    assert tool_metrics(ours) == tool_metrics(sync)
    assert _by_prompt(recorder.seen) == _by_prompt(reference.seen)


def test_an_openai_client_agent_trains_through_the_endpoint_on_the_vllm_backend(
    tmp_path, vllm_tool_server, vllm_tool_model_dir
):
    """The docs' example agent (examples/agent_openai.py) through the endpoint, the server sampling every request:
    each trained row is a recorded episode's sample, token for token, with the server's versions and mu."""
    from examples.agent_openai import agent
    from trl_async.agents import agent_reward, agent_rollout
    from trl_async.agents.episode import assemble

    rollout = agent_rollout(agent, timeout_s=120)
    trainer = AsyncGRPOTrainer(model=vllm_tool_model_dir, reward_funcs=agent_reward,
                               processing_class=tokenizer_of(vllm_tool_model_dir),
                               args=_vllm(tmp_path, vllm_tool_server.url), train_dataset=dataset(TRL_PROMPTS),
                               rollout_func=rollout)  # fmt: skip
    trainer.train()
    samples = [assemble(requests) for requests in rollout.episodes if requests]
    records = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 6
    for r in records:
        assert any(
            (list(s.prompt_ids), list(s.completion_ids), list(s.env_mask), list(s.versions))
            == (r["prompt_ids"], r["completion_ids"], r["tool_mask"], r["versions"])
            for s in samples
        ), r
    assert any(0 in r["tool_mask"] for r in records)  # a tool result inside a sample, masked
    from examples.agent_openai import TOOLS

    tokenizer = tokenizer_of(vllm_tool_model_dir)
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=TOOLS, add_generation_prompt=True,
                                              tokenize=True)["input_ids"] for p in TRL_PROMPTS]  # fmt: skip
    assert all(list(requests[0].prompt_ids) in rendered for requests in rollout.episodes if requests)
    # staleness 0: the server's mu of every sampled token against the trainer's teacher-forced forward of the same
    # weights (float32 on both sides; the engines' kernels differ in rounding only)
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert logs and all(abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3 for h in logs), logs
    rollout.close()
    assert no_rollout_children()
