"""A real vLLM CPU server killed at a chosen moment of a weight sync or a generate, restarted on its port: training
finishes its steps, no group is lost or trained twice, staleness stays within its bound, and after each re-attach the
server samples from the pushed weights. Each moment is reached deterministically: the kill is a hook on the step the
trainer is taking (the publish call, a bucket of the push, the re-attach probe's request, a generate request seen on
the wire), not a race with the clock."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse

from transformers import TrainerCallback

from tests.integration.test_lora_sync import VersionedTrainer
from tests.vllm.test_vllm_backend import _dataset, _vllm_args
from tests.vllm.test_vllm_reattach import MOVING, Forwarder, assert_sampled_from_their_versions, moving_reward
from tests.vllm_server import start_server
from trl_async.engines.vllm import backend as backend_module
from trl_async.engines.vllm.client import VLLMServer
from trl_async.engines.vllm.weight_push import gloo as push_module


class Restartable:
    """A server that a hook kills (SIGKILL to its process group) and that is then restarted on its port, as a
    supervisor would. ``hold()`` before a kill keeps it down until ``release()``: a test that needs the trainer at a
    chosen step when the server comes back does not race the restart."""

    def __init__(self, server, model_dir: str, log_dir) -> None:
        self.server, self.model_dir, self.log_dir = server, model_dir, log_dir
        self.port = urllib.parse.urlsplit(server.url).port
        self.url = server.url
        self.kills: list[str] = []
        self._thread: threading.Thread | None = None
        self._spawned: list = []
        self._released = threading.Event()
        self._released.set()

    def hold(self) -> None:
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def kill(self, moment: str) -> None:
        self.kills.append(moment)  # first: whoever plans the next kill sees this one at once
        self.server.stop()
        log = self.log_dir / f"restarted_{self.port}_{len(self.kills)}.log"

        def restart():
            self._released.wait()
            self.server = start_server(self.model_dir, log, port=self.port, spawned=self._spawned)

        self._thread = threading.Thread(target=restart, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._released.set()
        if self._thread is not None:
            self._thread.join(300)
        for server in [self.server, *self._spawned]:
            server.stop()


def lane_state(trainer, index: int) -> str:
    lane = trainer.rollout_pool.backend.current[index]
    return "attached" if lane.attached else lane.returning.state


def wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def record_reattaches(monkeypatch) -> list[int]:
    """The versions at which a server was re-attached, in order."""
    versions: list[int] = []
    reattach = backend_module.VLLMBackend._reattach

    def recorded(self, index, version, peers):
        reattach(self, index, version, peers)
        if self.current[index].attached:
            versions.append(version)

    monkeypatch.setattr(backend_module.VLLMBackend, "_reattach", recorded)
    return versions


def check_run(trainer, tmp_path, steps: int, batch: int, max_staleness: int, model_dir: str, since: int) -> None:
    """Every step trained a full batch, no group twice, within the staleness bound; the tokens generated after the
    last re-attach were sampled from the pushed weights of their version (mu equals a teacher-forced forward under
    that version, token by token: a completion sampled across a push holds tokens of two versions)."""
    assert trainer.state.global_step == steps
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    steps_of: dict[int, set] = {}
    for r in rows:
        steps_of.setdefault(r["group_id"], set()).add(r["step"])
        assert r["staleness"] <= max_staleness and all(
            r["step"] - max_staleness <= v <= r["step"] for v in r["versions"]
        )
    assert all(len(s) == 1 for s in steps_of.values())  # no group trained twice
    assert sorted({r["step"] for r in rows}) == list(range(steps)) and len(rows) == steps * batch  # none lost
    late = [r for r in rows if min(r["versions"]) >= since]
    assert len(late) >= 4, "no group came from the servers after the last re-attach"
    assert_sampled_from_their_versions(model_dir, trainer.snapshots, late[:16])


def kill_after_the_first_bucket(monkeypatch, armed: dict, server: Restartable, moment: str = "mid-push") -> None:
    """While ``armed["push"]``: the next push kills ``server`` once its first bucket has gone out."""
    send = push_module.send_buckets

    def send_then_maybe_die(group, buckets):
        def stream():
            for i, bucket in enumerate(buckets):
                if i == 1 and armed["push"]:
                    armed["push"] = False
                    server.kill(moment)
                yield bucket

        return send(group, stream())

    monkeypatch.setattr(push_module, "send_buckets", send_then_maybe_die)


def test_the_only_server_killed_before_a_publish_mid_generate_and_mid_push_heals_each_time(
    tmp_path, monkeypatch, vllm_model_dir, vllm_server_to_heal
):
    """One server, reached through an address that stays the same, killed three times, each once it was
    re-attached after the last: as the trainer enters a publish (nothing to push to: the push is skipped, the lane
    finds it gone); with a generate request in flight; and after the first bucket of a push. Training waits for it
    each time and finishes."""
    reattached_at = record_reattaches(monkeypatch)
    server = Restartable(vllm_server_to_heal, vllm_model_dir, tmp_path)
    url = Forwarder(("127.0.0.1", server.port))
    armed = {"publish": False, "generate": False, "push": False}
    publish = backend_module.VLLMBackend.publish

    def publish_then_maybe_die(self, buckets, version, *args, **kwargs):
        if armed["publish"]:
            armed["publish"] = False
            server.kill("before publish")
        return publish(self, buckets, version, *args, **kwargs)

    monkeypatch.setattr(backend_module.VLLMBackend, "publish", publish_then_maybe_die)
    kill_after_the_first_bucket(monkeypatch, armed, server)
    pump = Forwarder._pump
    once = threading.Lock()  # connections are pumped on threads of their own: one kill

    def forward_then_maybe_die(self, source, sink, target=None):
        if target is not None and armed["generate"]:  # a client's connection: is it a generate request?
            first = source.recv(65536, socket.MSG_PEEK)
            if first.startswith(b"POST /inference/v1/generate"):
                with once:
                    fire, armed["generate"] = armed["generate"], False
                if fire:
                    sink.sendall(source.recv(65536))  # the request reached the server: it dies with it in flight
                    server.kill("mid-generate")
        return pump(self, source, sink, target)

    monkeypatch.setattr(Forwarder, "_pump", forward_then_maybe_die)
    plan = ["before publish", "mid-generate", "mid-push"]

    class Moments(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            done = len(server.kills)
            if done == len(plan) or any(armed.values()) or lane_state(trainer, 0) != "attached":
                return
            if len(reattached_at) < done:  # (the first kill needs no re-attach before it)
                return
            if train_state.global_step >= 2:
                armed[{"before publish": "publish", "mid-generate": "generate", "mid-push": "push"}[plan[done]]] = True

    args = _vllm_args(tmp_path, url.url, max_steps=14, max_staleness=1, rollout_heartbeat_timeout_s=3,
                      rollout_vllm_retry_s=300, weight_sync_bucket_mb=0.05,
                      rollout_trajectory_file="traj.jsonl", **MOVING)  # fmt: skip
    trainer = VersionedTrainer(model=vllm_model_dir, reward_funcs=moving_reward, args=args, train_dataset=_dataset(),
                               callbacks=[Moments()])  # fmt: skip
    try:
        trainer.train()
    finally:
        url.close()
        server.stop()
    assert server.kills == plan
    assert [r["url"] for r in trainer.last_rollout_pool.backend.reattached] == [url.url] * 3
    check_run(trainer, tmp_path, 14, 8, 1, vllm_model_dir, reattached_at[-1])


def test_two_servers_one_killed_mid_push_then_the_other_during_the_re_attach_probe(
    tmp_path, monkeypatch, vllm_model_dir, vllm_pair_to_heal
):
    """Two servers. One dies after the first bucket of a push: both leave the broken push (the survivor is paused
    with mixed weights), and each is re-attached with the whole version, the survivor at once. When the killed one is
    back, its peer dies during the greedy probe that compares them: the returning one is attached at the next push,
    and the peer once it is back in turn. The killed server stays down until the probe is armed (a quick restart
    would otherwise be re-attached, unprobed by this hook, before the moment is set)."""
    first, second = (Restartable(s, vllm_model_dir, tmp_path) for s in vllm_pair_to_heal)
    second.hold()
    reattached_at = record_reattaches(monkeypatch)
    armed = {"push": False, "probe": False}
    kill_after_the_first_bucket(monkeypatch, armed, second)
    generate = VLLMServer.generate

    def generate_or_die(self, prompt_ids, params, *args, **kwargs):
        if armed["probe"] and tuple(prompt_ids) == backend_module.PROBE and self.url == first.url:
            armed["probe"] = False
            first.kill("during the probe")  # the peer the returning server is compared with
        return generate(self, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(VLLMServer, "generate", generate_or_die)

    class Moments(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            step = train_state.global_step
            if step == 2:
                armed["push"] = True
            if step == 4:  # the other server works meanwhile (re-attached at once: it never went down)
                assert second.kills == ["mid-push"], second.kills
                armed["probe"] = True  # its re-attach, at a publish from here on, probes it against the other
                second.release()
                wait_for(lambda: lane_state(trainer, 1) == "back", "the server killed mid-push was not seen back")
            if step == 7:  # the killed peer is back before the end: re-attached, probed against the other
                wait_for(lambda: lane_state(trainer, 0) in ("back", "attached"), "the peer was not seen back")

    args = _vllm_args(tmp_path, first.url, max_steps=10, max_staleness=1, rollout_heartbeat_timeout_s=3,
                      rollout_vllm_retry_s=300, weight_sync_bucket_mb=0.05, rollout_trajectory_file="traj.jsonl",
                      rollout_vllm_urls=[first.url, second.url], **MOVING)  # fmt: skip
    trainer = VersionedTrainer(model=vllm_model_dir, reward_funcs=moving_reward, args=args, train_dataset=_dataset(),
                               callbacks=[Moments()])  # fmt: skip
    try:
        trainer.train()
    finally:
        first.stop()
        second.stop()
    assert second.kills == ["mid-push"] and first.kills == ["during the probe"]
    reattached = [r["url"] for r in trainer.last_rollout_pool.backend.reattached]
    assert second.url in reattached and first.url in reattached, reattached
    check_run(trainer, tmp_path, 10, 8, 1, vllm_model_dir, reattached_at[-1])
