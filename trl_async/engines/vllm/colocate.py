"""``vllm_mode='colocate'``: vLLM servers the trainer starts on its own GPUs, owns, and stops with training.

GRPOTrainer's colocate mode runs vLLM inside each training process and alternates: generate, then train. Here the
engine must generate *while* the trainer steps, so it runs as a server process beside the trainer, on the same GPU,
and is driven exactly like a server the user started (``backend.py``): weights pushed over NCCL (gloo for a CPU
trainer), one lane per server. GRPOConfig's colocate fields size it: ``vllm_gpu_memory_utilization``,
``vllm_tensor_parallel_size``, ``vllm_max_model_length`` and ``vllm_model_impl``.

Lifecycle: the main process starts the servers when the pool starts, the backend waits for them
(``vllm_server_timeout``), and ``stop`` ends each one's whole process group (SIGTERM, then SIGKILL) when the pool
closes: at the end of ``train``, on an error and on Ctrl-C. A server is also sent SIGTERM if the trainer process dies
(``PR_SET_PDEATHSIG``, Linux). With several trainer ranks on one machine, each rank's GPU gets a server
(``vllm_tensor_parallel_size=1``), or one server spans them all (``vllm_tensor_parallel_size`` = their number).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .serve import server_command
from .weight_push.fan_out import free_port


def server_gpu_groups(gpus: list[str], hosts: list[str], tensor_parallel_size: int) -> list[list[str]]:
    """The GPUs (``CUDA_VISIBLE_DEVICES`` entries) of each colocated server, from each trainer rank's GPU and host.
    Raises ``ValueError`` naming the field when no layout fits."""
    if len(set(hosts)) > 1:
        raise ValueError(
            "GRPOConfig.vllm_mode='colocate' with trainer ranks on several machines: the servers are started and "
            "driven by the main process, on its own machine. Start a server per machine with `python -m "
            "trl_async.engines.vllm.serve` (or `trl vllm-serve`) and use vllm_mode='server' with rollout_vllm_urls"
        )
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GRPOConfig.vllm_mode='colocate': trainer ranks share GPUs {gpus}; give each rank its own")
    if tensor_parallel_size == 1:
        return [[gpu] for gpu in gpus]
    if tensor_parallel_size == len(gpus):
        return [list(gpus)]
    raise ValueError(
        f"GRPOConfig.vllm_tensor_parallel_size={tensor_parallel_size} is invalid with vllm_mode='colocate' and "
        f"{len(gpus)} trainer GPU(s): use 1 (a server on each rank's GPU) or {len(gpus)} (one server over all of them)"
    )


def colocated_flags(
    max_model_len: int | None,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    model_impl: str,
    dtype: str,
    on_gpu: bool,
) -> list[str]:
    """``vllm serve`` arguments from GRPOConfig's colocate fields and the trainer's compute dtype."""
    flags = ["--dtype", dtype, "--model-impl", model_impl, "--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len is not None:
        flags += ["--max-model-len", str(max_model_len)]
    if on_gpu:
        flags += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return flags


try:  # loaded here: the child runs only the call between fork and exec (no import, no lock another thread may hold)
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)
except (OSError, ImportError):  # not Linux: no parent-death signal
    _LIBC = None


def _die_with(parent: int):
    def arm() -> None:
        if _LIBC is not None and hasattr(_LIBC, "prctl"):
            _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the trainer's process dies
            if os.getppid() != parent:  # it died before the signal was armed
                os._exit(1)

    return arm


@dataclass(eq=False)
class ColocatedServer:
    url: str
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(
        cls, model: str, transport: str, flags: list[str], gpus: list[str] | None, log: Path, python: str | None = None
    ) -> ColocatedServer:
        """A server for ``model`` on ``gpus`` (None: the CPU), listening on a free local port."""
        port = free_port()
        command = server_command(model, "127.0.0.1", port, transport, flags)
        command[0] = python or sys.executable
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        for name in [n for n in env if n.startswith("TORCHELASTIC_")] + [
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ]:
            env.pop(name, None)  # the trainer's process group is not the server's
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()),
            )
        return cls(f"http://127.0.0.1:{port}", process, log)

    def exited(self) -> str | None:
        """Why the server is gone (its exit status and the end of its log), or None while it runs."""
        if self.process.poll() is None:
            return None
        status = self.process.returncode
        return f"the colocated vLLM server exited with status {status}; its log ends with:\n{self.tail()}"

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """End the server and every process it started (its process group): SIGTERM, then SIGKILL after
        ``grace_s``; returns once none is left."""
        group = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.process.poll()  # reaps the server itself; its children are reparented
                if not _group_alive(group):
                    break
                time.sleep(0.2)
            if not _group_alive(group):
                break
        self.process.poll()


def _group_alive(group: int) -> bool:
    """Whether any process of the group is still running (zombies, which hold no memory, do not count)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == group and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
                    return True
    return not os.path.isdir("/proc")


def trainer_gpu_groups(accelerator, tensor_parallel_size: int) -> list[list[str] | None]:
    """Every rank's GPU gathered (a collective: call it on every rank), laid out into servers by
    ``server_gpu_groups``; ``[None]`` (one server on the CPU) for a CPU trainer."""
    import socket

    from accelerate.utils import gather_object

    from ...config.engine_choice import physical_gpu

    device = accelerator.device
    if device.type != "cuda":
        return [None]
    mine = physical_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"), device.index or 0)
    everyone = (
        gather_object([(socket.gethostname(), mine)])
        if accelerator.num_processes > 1
        else [(socket.gethostname(), mine)]
    )
    return server_gpu_groups([gpu for _, gpu in everyone], [host for host, _ in everyone], tensor_parallel_size)


def wait_for(servers: list[ColocatedServer], timeout_s: float) -> None:
    """Until every server answers ``/health``; raises at once, with its log, if one exits first, and after
    ``timeout_s`` (``vllm_server_timeout``) if one never answers."""
    from .client import VLLMServer

    deadline = time.monotonic() + timeout_s
    for server in servers:
        client = VLLMServer(server.url)
        while not client.healthy():
            gone = server.exited()
            if gone is not None:
                raise RuntimeError(gone)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the colocated vLLM server {server.url} did not answer within {timeout_s:.0f}s "
                    f"(vllm_server_timeout); its log ends with:\n{server.tail()}"
                )
            time.sleep(0.5)
