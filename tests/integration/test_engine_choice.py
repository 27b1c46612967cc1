"""Which engine generates and where (trl_async/config/engine_choice.py), worked out by hand; a colocated server's layout,
flags and lifecycle (engines/vllm/colocate.py); the weight transport read from a server (engines/vllm/backend.py)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest

from trl_async.config.engine_choice import DeviceChoice, EngineChoice, physical_gpu, rollout_device_for, rollout_engine
from trl_async.engines.vllm.client import VLLMServerError
from trl_async.engines.vllm.colocate import ColocatedServer, colocated_flags, server_gpu_groups
from trl_async.engines.vllm.server_checks import served_transport


@pytest.mark.unit
def test_trls_vllm_fields_choose_the_engine():
    assert rollout_engine(None, False, "colocate", None) == EngineChoice("transformers", False)  # TRL's default mode
    assert rollout_engine("vllm", False, "colocate", ["http://a:1"]) == EngineChoice("vllm", False)  # ours, as before
    assert rollout_engine(None, True, "server", None) == EngineChoice("vllm", False)
    assert rollout_engine("vllm", True, "server", ["http://a:1", "http://b:1"]) == EngineChoice("vllm", False)
    assert rollout_engine(None, True, "colocate", None) == EngineChoice("vllm", True)
    with pytest.raises(ValueError, match="rollout_backend='transformers' contradicts use_vllm=True"):
        rollout_engine("transformers", True, "server", None)
    with pytest.raises(ValueError, match="rollout_vllm_urls=.*names running servers.*vllm_mode='server'"):
        rollout_engine(None, True, "colocate", ["http://a:1"])
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True"):
        rollout_engine(None, True, "colocate", None, vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match="vllm_mode='remote' is invalid"):
        rollout_engine(None, True, "remote", None)


@pytest.mark.unit
def test_the_config_resolves_trls_fields_and_grpo_trainer_sees_no_vllm_of_its_own():
    from trl import GRPOConfig

    from trl_async import AsyncGRPOConfig
    from trl_async.config import for_grpo_trainer, resolve_settings

    base = dict(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False)
    args = AsyncGRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://h:8000", **base)
    assert args.rollout_backend is None  # as set: resolved wherever the settings are read
    assert (resolve_settings(args).rollout_backend, resolve_settings(args).vllm_colocate) == ("vllm", False)
    copied = copy.copy(args)  # a copy with TRL's switch turned off follows it
    copied.use_vllm = False
    assert resolve_settings(copied).rollout_backend == "transformers"
    parent = for_grpo_trainer(args)
    assert parent is not args and parent.use_vllm is False and args.use_vllm is True
    plain = GRPOConfig(use_vllm=True, vllm_mode="colocate", **base)  # a plain GRPOConfig swapped in
    settings = resolve_settings(plain)
    assert (settings.rollout_backend, settings.vllm_colocate) == ("vllm", True)
    assert for_grpo_trainer(GRPOConfig(**base)).use_vllm is False
    # with vLLM, GRPOTrainer ignores its continuous batching switch, evaluation included; without, it keeps it
    batching = dict(use_transformers_continuous_batching=True, **base)
    served = for_grpo_trainer(GRPOConfig(use_vllm=True, vllm_mode="server", **batching))
    assert served.use_transformers_continuous_batching is False
    assert for_grpo_trainer(GRPOConfig(**batching)).use_transformers_continuous_batching is True
    with pytest.raises(ValueError, match="AsyncGRPOConfig.rollout_backend='transformers' contradicts"):
        AsyncGRPOConfig(use_vllm=True, rollout_backend="transformers", **base)


@pytest.mark.unit
def test_where_the_transformers_workers_generate():
    assert rollout_device_for("cuda:3", "cuda:0", 4, {0}) == DeviceChoice("cuda:3", "rollout_device")
    assert rollout_device_for(None, "cpu", 0, set()).device == "cpu"
    assert rollout_device_for(None, "cuda:0", 2, {0}) == DeviceChoice("cuda:1", "a GPU no trainer rank uses")
    assert rollout_device_for(None, "cuda:1", 4, {0, 1}).device == "cuda:2"  # two ranks train on 0 and 1
    shared = rollout_device_for(None, "cuda:1", 2, {0, 1})  # every GPU trains: the rank's own
    assert shared.device == "cuda:1" and "share the trainer's (cuda:1)" in shared.reason
    assert rollout_device_for(None, "cuda", 1, {0}).device == "cuda:0"
    assert rollout_device_for("cpu", "cuda:0", 2, {0}).device == "cpu"  # asked for: the CPU


@pytest.mark.unit
def test_the_gpu_a_child_process_must_be_given():
    assert physical_gpu(None, 1) == "1"
    assert physical_gpu("4,5", 1) == "5"
    assert physical_gpu(" 2 , 7", 0) == "2"
    assert physical_gpu("GPU-ab12", 0) == "GPU-ab12"
    with pytest.raises(ValueError, match="cuda:2 is not among"):
        physical_gpu("0,1", 2)


@pytest.mark.unit
def test_colocated_servers_are_laid_out_over_the_trainer_gpus():
    assert server_gpu_groups(["0"], ["h"], 1) == [["0"]]
    assert server_gpu_groups(["0", "1"], ["h", "h"], 1) == [["0"], ["1"]]  # a server on each rank's GPU
    assert server_gpu_groups(["0", "1"], ["h", "h"], 2) == [["0", "1"]]  # one over both
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 is invalid.*use 1.*or 4"):
        server_gpu_groups(["0", "1", "2", "3"], ["h"] * 4, 2)
    with pytest.raises(ValueError, match="several machines.*vllm_mode='server'"):
        server_gpu_groups(["0", "0"], ["a", "b"], 1)
    with pytest.raises(ValueError, match="share GPUs"):
        server_gpu_groups(["0", "0"], ["h", "h"], 1)
    assert colocated_flags(512, 0.4, 1, "vllm", "bfloat16", on_gpu=True) == [
        "--dtype", "bfloat16", "--model-impl", "vllm", "--tensor-parallel-size", "1", "--max-model-len", "512",
        "--gpu-memory-utilization", "0.4"]  # fmt: skip
    assert "--gpu-memory-utilization" not in colocated_flags(None, 0.3, 1, "vllm", "float32", on_gpu=False)


def _info(engine):
    return {"vllm_config": {"weight_transfer_config": {"backend": engine} if engine else None}}


@pytest.mark.unit
def test_the_weight_transport_is_the_one_the_servers_were_started_with(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec  # the trainer's end of NCCL is vLLM's engine: present here
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    urls = ["http://a:1", "http://b:1"]
    assert served_transport("auto", [_info("nccl")] * 2, urls, "cuda:0") == "nccl"  # trl vllm-serve's
    assert served_transport("auto", [_info("trl_async_gloo")], urls[:1], "cpu") == "gloo"
    assert served_transport("gloo", [_info("trl_async_gloo")], urls[:1], "cuda:0") == "gloo"
    with pytest.raises(VLLMServerError, match="http://a:1 has no weight-transfer engine.*--weight-transfer-config"):
        served_transport("auto", [_info(None)], urls[:1], "cuda:0")
    with pytest.raises(VLLMServerError, match="different weight transports"):
        served_transport("auto", [_info("nccl"), _info("trl_async_gloo")], urls, "cuda:0")
    with pytest.raises(VLLMServerError, match="has no 'nccl' weight-transfer engine \\(it was started with gloo\\)"):
        served_transport("nccl", [_info("trl_async_gloo")], urls[:1], "cuda:0")
    with pytest.raises(VLLMServerError, match="NCCL, which needs the trainer on a GPU, but it runs on cpu"):
        served_transport("auto", [_info("nccl")], urls[:1], "cpu")


FAKE_SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a child of its own, as vLLM's engine
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def _group_members(pgid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


@pytest.mark.unit
def test_a_colocated_server_is_stopped_with_every_process_it_started(tmp_path, monkeypatch):
    """A stand-in server (it answers /health and starts a child of its own, as vLLM starts its engine) is started
    the colocated way; stop() leaves no process of its group, even one that ignores SIGTERM."""
    from trl_async.engines.vllm import colocate

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(colocate, "server_command", lambda model, host, port, transport, flags: [
        sys.executable, str(script), "--port", str(port)])  # fmt: skip
    server = ColocatedServer.start("m", "gloo", [], None, tmp_path / "server.log")
    colocate.wait_for([server], timeout_s=30)
    deadline = time.monotonic() + 10
    while len(_group_members(server.process.pid)) < 2:  # the server and its child
        assert time.monotonic() < deadline
        time.sleep(0.1)
    subprocess.run(["kill", "-STOP", str(server.process.pid)])  # deaf to SIGTERM: only SIGKILL ends it
    server.stop(grace_s=1.0)
    assert _group_members(server.process.pid) == [] and server.exited() is not None


@pytest.mark.unit
def test_a_colocated_server_that_cannot_start_fails_at_once_with_its_log(tmp_path):
    """The trainer's own Python has no vLLM: the server exits at once, and the wait says so with its log instead of
    waiting out vllm_server_timeout."""
    from trl_async.engines.vllm.colocate import wait_for

    server = ColocatedServer.start("m", "gloo", [], None, tmp_path / "server.log", python=sys.executable)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)exited with status 1.*No module named 'vllm'"):
        wait_for([server], timeout_s=120)
    assert time.monotonic() - started < 60
    server.stop()


@pytest.mark.unit
def test_nccl_pushes_without_vllm_in_the_trainers_environment_name_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(VLLMServerError, match=r"install vLLM in the trainer's environment too.*pip install vllm"):
        served_transport("auto", [_info("nccl")], ["http://a:1"], "cuda:0")
    assert served_transport("auto", [_info("trl_async_gloo")], ["http://a:1"], "cpu") == "gloo"  # gloo: ours alone
