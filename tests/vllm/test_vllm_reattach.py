"""vLLM servers that come back (engines/vllm/weight_push/recovery.py): the waiting lane's rules by hand, then a real server
killed mid-run and restarted on its port while training goes on with another one."""

from __future__ import annotations

import pytest

from trl_async.engines.vllm.weight_push.recovery import Return, identity


def _info(model="/models/a", rank=None):
    """The parts of /server_info that identity() reads."""
    return {"vllm_config": {"model_config": {"model": model, "max_model_len": 256, "dtype": "torch.float32",
                                              "logprobs_mode": "processed_logprobs"},
                            "lora_config": {"max_lora_rank": rank} if rank else None,
                            "weight_transfer_config": {"backend": "trl_async_gloo"}}}  # fmt: skip


@pytest.mark.unit
def test_a_server_is_taken_back_only_as_the_same_server():
    back = Return("http://s:1", identity(_info()), down_limit_s=100, retry_s=10, others_attached=lambda: True,
                  down_since=0.0)  # fmt: skip
    assert back.watch(False, _info, now=5.0) is None and back.state == "down"
    assert back.watch(True, _info, now=6.0) is None and back.state == "back" and back.back_at == 6.0
    assert back.watch(False, _info, now=7.0) is None and back.state == "down"  # gone again before re-attached
    assert back.watch(True, _info, now=8.0) is None and back.state == "back"
    assert back.attach(now=9.5) == 9.5 and back.attached

    other = Return("http://s:1", identity(_info()), 100, 10, lambda: True, down_since=0.0)
    why = other.watch(True, lambda: _info(model="/models/b"), now=1.0)
    assert "came back serving something else: {'model': ('/models/a', '/models/b')}" in why and "refused" in why
    lora = Return("http://s:1", identity(_info(rank=16)), 100, 10, lambda: True, down_since=0.0)
    assert "'max_lora_rank': (16, None)" in lora.watch(True, _info, now=1.0)  # restarted without --enable-lora


@pytest.mark.unit
def test_the_limits_on_waiting_for_a_server():
    others = {"up": True}
    gone = Return("http://s:1", identity(_info()), down_limit_s=100, retry_s=10, others_attached=lambda: others["up"],
                  down_since=0.0)  # fmt: skip
    assert gone.watch(False, _info, now=50.0) is None  # another server works: keep waiting
    others["up"] = False
    assert "every vLLM server is down; http://s:1 for 50s (rollout_vllm_retry_s=10)" in gone.watch(False, _info, 50.0)
    others["up"] = True
    assert "down for 101s (rollout_vllm_down_limit_s=100)" in gone.watch(False, _info, now=101.0)
    patient = Return("http://s:1", identity(_info()), None, 10, lambda: True, down_since=0.0)
    assert patient.watch(False, _info, now=10_000.0) is None  # no limit while others work


def test_a_killed_server_restarted_on_its_port_is_reattached_and_nothing_is_lost(
    tmp_path, vllm_server, vllm_model_dir, vllm_server_to_restart
):
    """Two servers; after step 2 one is killed (SIGKILL to all its processes) and restarted on its port. Training goes
    on with the other; what the killed one held is generated again; once it answers, the next weight sync re-attaches
    it, and its tokens are then sampled from the pushed version (mu equals a teacher-forced forward of it)."""
    import json
    import threading
    import time
    import urllib.parse

    from transformers import TrainerCallback

    from tests.integration.test_lora_sync import VersionedTrainer
    from tests.vllm.test_vllm_backend import _dataset, _vllm_args
    from tests.vllm_server import start_server

    second = vllm_server_to_restart
    port = urllib.parse.urlsplit(second.url).port
    state = {}

    class KillAndRestart(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            pool = trainer.rollout_pool
            if train_state.global_step == 2:
                second.stop()
                state["held"] = [(t.group_id, t.prompt_index) for t in pool.outstanding(1)]
                state["killed_at"], state["killed_time"] = train_state.global_step, time.time()

                def restart():
                    state["restarted"] = start_server(vllm_model_dir, tmp_path / "b2.log", port=port)

                state["thread"] = threading.Thread(target=restart, daemon=True)
                state["thread"].start()
            if train_state.global_step == 6:  # training went on without it; now let it come back before the end
                state["trained_while_down"] = state["thread"].is_alive()
                state["thread"].join(240)
                deadline = time.monotonic() + 60
                while True:  # its lane replaced by one that waits, and that one has seen it back
                    returning = pool.lanes.current[1].returning
                    if returning is not None and returning.state in ("back", "attached"):
                        break
                    assert time.monotonic() < deadline, "the restarted server was not seen back"
                    time.sleep(0.2)
            if train_state.global_step == 7:  # re-attached at the publish after step 6: hold training (a step takes
                # ~50 ms here) until the restarted server has returned a group, which then trains at staleness <= 1
                deadline = time.monotonic() + 90
                while not any(kind == "generate" and worker == 1 and start > state["killed_time"]
                              for kind, worker, start, _ in list(pool.activity)):  # fmt: skip
                    assert time.monotonic() < deadline, "the re-attached server returned no group"
                    time.sleep(0.2)

    args = _vllm_args(tmp_path, vllm_server.url, max_steps=12, max_staleness=1, rollout_heartbeat_timeout_s=3,
                      rollout_vllm_retry_s=20, per_device_train_batch_size=8, **MOVING,
                      rollout_vllm_urls=[vllm_server.url, second.url])  # fmt: skip
    trainer = VersionedTrainer(model=vllm_model_dir, reward_funcs=moving_reward, args=args, train_dataset=_dataset(),
                               callbacks=[KillAndRestart()])  # fmt: skip
    try:
        trainer.train()
    finally:
        second.stop()
        if "restarted" in state:
            state["restarted"].stop()
    assert trainer.state.global_step == 12 and state["trained_while_down"]
    backend = trainer.last_rollout_pool.backend
    assert [r["url"] for r in backend.reattached] == [second.url]
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], set()).add(r["step"])
        assert r["staleness"] <= 1 and all(r["step"] - 1 <= v <= r["step"] for v in r["versions"])
    assert all(len(steps) == 1 for steps in groups.values())  # no group trained twice
    assert sorted({r["step"] for r in rows}) == list(range(12)) and len(rows) == 12 * 8  # every batch full
    trained = {(r["group_id"], r["prompt_index"]) for r in rows}
    later = [r["prompt_index"] for r in rows if r["step"] >= state["killed_at"]]
    for group_id, prompt_index in state["held"]:  # each group it held trained, or its prompt was generated again
        assert (group_id, prompt_index) in trained or prompt_index in later
    # after the re-attach the restarted server samples from the pushed weights of each token's version
    after = [r for r in rows if r["worker_id"] == 1 and r["step"] > state["killed_at"]]  # the restarted server's
    assert after, "the restarted server took no work after it was re-attached"
    assert len(after) >= 4
    assert_sampled_from_their_versions(vllm_model_dir, trainer.snapshots, after[:16])


def moving_reward(completions, **kwargs):
    """Differs between almost any two completions: nearly every group has an advantage, so each step moves the
    weights (with ``MOVING``'s learning rate, short of collapsing the policy) far enough to tell versions apart."""
    return [sum(map(ord, c)) % 11 / 10 for c in completions]


MOVING = {"learning_rate": 1e-2, "lr_scheduler_type": "constant"}


def assert_sampled_from_their_versions(model_dir: str, snapshots: dict, rows: list[dict]) -> None:
    """Each completion token's mu equals a teacher-forced forward under the pushed weights of the version it was
    sampled with (a completion that a push overtook holds tokens of two versions, each checked against its own).
    The check must be able to fail: on most rows the version before would have missed by far more than the
    tolerance."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def forward(version: int, r: dict) -> torch.Tensor:
        loaded = model.load_state_dict(snapshots[version], strict=False)
        assert not loaded.unexpected_keys and len(loaded.missing_keys) <= 1  # (lm_head, tied to the embedding)
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(r["prompt_ids"]) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(r["completion_ids"])[:, None])[:, 0]

    misses_of_the_version_before = []
    for r in rows:
        assert len(r["versions"]) == len(r["completion_ids"]) == len(r["logprobs"])
        for version in sorted(set(r["versions"])):
            mine = torch.tensor(r["versions"]) == version
            mu = torch.tensor(r["logprobs"])[mine]
            torch.testing.assert_close(mu, forward(version, r)[mine], rtol=0, atol=1e-3)
            if version > 0:
                misses_of_the_version_before.append((mu - forward(version - 1, r)[mine]).abs().max().item())
    told_apart = [miss > 1e-2 for miss in misses_of_the_version_before]
    assert len(told_apart) >= 4, "too few tokens after a first push to tell versions apart"
    assert sum(told_apart) >= len(told_apart) / 2, misses_of_the_version_before


class Forwarder:
    """A TCP port that forwards every connection to ``target`` (a real server), refuses connections while ``target``
    is None (the server is down), and can be pointed at another server: what a client sees when the process behind a
    URL (a supervisor's, a load balancer's) is restarted as something else."""

    def __init__(self, target: tuple[str, int] | None) -> None:
        import socket
        import threading

        self.target = target
        self.requests: list[tuple[tuple[str, int], str]] = []  # (server, request line) of each connection forwarded
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            target = self.target
            if target is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, target), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source, sink, target=None) -> None:
        import socket

        try:
            while data := source.recv(65536):
                if target is not None:  # the client's side: its first bytes carry the request line
                    self.requests.append((target, data.split(b"\r\n", 1)[0].decode(errors="replace")))
                    target = None
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_a_server_that_comes_back_serving_another_model_is_refused_with_both_named(
    tmp_path, vllm_server, vllm_model_dir, vllm_tool_server, vllm_tool_model_dir
):
    """Training talks to its server through a URL; after step 2 the URL stops answering, and when it answers again
    another real vLLM server is behind it, serving a different model (the tool-calling one). The waiting lane
    reads its /server_info, refuses it, and training stops with an error naming the URL and both models; no request
    was sent to the other server."""
    import time
    import urllib.parse

    from transformers import TrainerCallback

    from tests.vllm.test_vllm_backend import _dataset, _reward, _vllm_args
    from trl_async import AsyncGRPOTrainer

    def address(url: str) -> tuple[str, int]:
        parts = urllib.parse.urlsplit(url)
        return parts.hostname, parts.port

    url = Forwarder(address(vllm_server.url))

    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                url.target = None  # down
                deadline = time.monotonic() + 60
                while trainer.rollout_pool.lanes.current[0].returning is None:  # its lane replaced by one that waits
                    assert time.monotonic() < deadline, "the lost server's lane was not replaced"
                    time.sleep(0.2)
                url.target = address(vllm_tool_server.url)  # back, as another model

    args = _vllm_args(tmp_path, url.url, max_steps=30, max_staleness=1, rollout_heartbeat_timeout_s=3,
                      rollout_vllm_retry_s=60)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                               callbacks=[Replace()])  # fmt: skip
    try:
        with pytest.raises(Exception, match="came back serving something else") as excinfo:
            trainer.train()
    finally:
        url.close()
    message = str(excinfo.value)
    assert url.url in message and "refused" in message
    assert f"'model': ('{vllm_model_dir}', '{vllm_tool_model_dir}')" in message, message
    assert 2 <= trainer.state.global_step < 30
    other = [line for server, line in url.requests if server == address(vllm_tool_server.url)]
    assert any("/server_info" in line for line in other), url.requests  # it was asked who it is ...
    assert not [line for line in other if line.startswith("POST")], other  # ... and never given work


def test_the_only_server_restarted_between_two_pushes_gets_its_transport_before_any_weights(
    tmp_path, vllm_model_dir, vllm_lone_server
):
    """A server started as TRL's `trl vllm-serve` starts it, and a trainer configured with GRPOTrainer's own fields
    (``use_vllm=True``, ``vllm_mode='server'``, ``vllm_server_base_url``; the transport read from the server). The
    one server is killed at a step boundary and restarted on its port, the same way. No push can go out while it is
    down (no server to push to), so the push after it is back goes to the same members as the last one before it was
    lost, but the server is a new process: it must be sent ``/init_weight_transfer_engine`` before
    ``/update_weights`` (pushing over the dead process's group fails or reaches nobody). Training waits for it and
    finishes."""
    import threading
    import time
    import urllib.parse

    from transformers import TrainerCallback

    from tests.vllm.test_vllm_backend import _dataset, _reward, _vllm_args
    from tests.vllm_server import start_server
    from trl_async import AsyncGRPOTrainer

    server = vllm_lone_server
    target = ("127.0.0.1", urllib.parse.urlsplit(server.url).port)
    url = Forwarder(target)  # the same address throughout; records each request and which process got it
    state = {}

    class KillAndRestart(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            if train_state.global_step == 2:
                server.stop()
                state["killed_at"] = len(url.requests)

                def restart():
                    state["restarted"] = start_server(vllm_model_dir, tmp_path / "restarted.log", port=target[1],
                                                      trl_style=True)  # fmt: skip

                threading.Thread(target=restart, daemon=True).start()

    # 6 s: room for one slow health check (2 s to time out, 0.5 s apart) on a loaded machine, so the one re-attach
    # counted below is the only one; the restart takes far longer than the detection
    args = _vllm_args(tmp_path, None, max_steps=5, max_staleness=1, rollout_heartbeat_timeout_s=6,
                      rollout_vllm_retry_s=300, rollout_backend=None, rollout_vllm_urls=None, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=url.url)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                               callbacks=[KillAndRestart()])  # fmt: skip
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        url.close()
        if "restarted" in state:
            state["restarted"].stop()
    assert trainer.state.global_step == 5, time.monotonic() - started
    assert [r["url"] for r in trainer.last_rollout_pool.backend.reattached] == [url.url]
    after = [line.split()[1].split("?")[0] for _, line in url.requests[state["killed_at"] :]]
    transfer = [p for p in after if p in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights")]
    assert transfer[:1] == ["/init_weight_transfer_engine"], transfer  # its transport first, then weights
    assert "/update_weights" in transfer and "/inference/v1/generate" in after[after.index("/update_weights") :]
