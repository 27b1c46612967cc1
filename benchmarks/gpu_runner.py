"""The runner of benchmarks/gpu_plan.py: both tracks, each phase as a process in its own group under its time box, the
servers the phases share, and each phase's result written the moment it ends. Started by ``gpu_plan.py call`` in a
session of its own; on a GPU it uses the standard library only, the phases' processes do the work."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpu_plan import DRY_SIDE_GRACE_S, HERE, PHASES, REPO, SIDE_GRACE_S, Phase, box_for, phase_result

BENCH_STEPS = 8  # optimizer steps per server configuration, equal for every one
COLOCATE_STEPS = 5
GPU_SERVER = ["--attention-backend", "TRITON_ATTN"]  # flash attention's kernels do not travel (their size)
CPU_SERVER = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
        return True
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc): a launcher's ranks may run in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_group(process) -> None:
    """SIGKILL the process's group and every process below it, each with its own group; wait for the process."""
    for pid in [process.pid, *descendants(process.pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    process.wait()


class Runner:
    def __init__(self, stage: Path, dry: bool, deadline: float, overrides: dict | None = None) -> None:
        self.stage, self.dry, self.deadline, self.overrides = stage, dry, deadline, overrides or {}
        self.logs, self.results = stage / "logs", stage / "results"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, tuple[subprocess.Popen, list[str], str]] = {}  # name: process, command, url
        self.lock = threading.Lock()
        self.side_over, self.stop_side = threading.Event(), threading.Event()
        self.model = str(stage / "model") if dry else None  # the real model's path (the tiny one in a rehearsal)
        self.tiny = str(stage / "tiny")
        # the FSDP2 verdict's model, then its mark (made by whichever track needs it first)
        self.make_tiny_fsdp2 = (f"save_tiny_model({str(stage / 'tiny_fsdp2')!r}, hidden_size=64, num_heads=2); "
                                f"open({str(stage / 'tiny_fsdp2.done')!r}, 'w').close()")  # fmt: skip

    # ---- plumbing -----------------------------------------------------------------------------------------------
    def env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "BENCH_RESULTS_DIR": str(self.results / "bench")}
        site = [] if self.dry else ["/tmp/site"]
        env["PYTHONPATH"] = os.pathsep.join([*site, str(REPO), str(HERE)])
        if self.dry:
            env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
        else:  # vLLM's own sampler: flashinfer does not travel
            env.update(VLLM_USE_FLASHINFER_SAMPLER="0", TRL_ASYNC_CACHE="/tmp/trl_async_cache")
        return env

    def arrived(self, needs: tuple[str, ...]) -> bool:
        return all((self.stage / "ready" / n).exists() for n in needs)

    def command(self, phase: Phase, argv: list[str], box: float, env: dict | None = None) -> dict:
        """Run ``argv`` in its own process group; killed at the end of ``box`` (status "cut"), or when the side track
        is stopped for a phase that measures speed."""
        with open(self.logs / f"{phase.name}.log", "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or self.env(), cwd=REPO,
                                       start_new_session=True)  # fmt: skip
            end = time.time() + box
            while process.poll() is None:
                stopped = phase.track == "side" and self.stop_side.is_set()
                if time.time() > end or stopped:
                    kill_group(process)
                    why = "the main track needed the GPU alone" if stopped else f"its box of {box:.0f} s ran out"
                    return {"status": "cut", "why": why}
                time.sleep(0.5)
        return {"status": "ok" if process.returncode == 0 else "failed", "exit": process.returncode}

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    # ---- servers ------------------------------------------------------------------------------------------------
    def server_command(self, model: str, port: int, speed: bool) -> list[str]:
        if self.dry:  # TRL's `trl vllm-serve` command, entered through the CPU build's API server (tests do the same)
            from trl_async.engines.vllm.serve import server_command

            command = server_command(model, "127.0.0.1", port, "gloo", CPU_SERVER)
            command[0] = str(REPO / ".venv-vllm" / "bin" / "python")
            return command
        size = ["--max_model_len", "1024", "--dtype", "bfloat16"] if speed else ["--max_model_len", "256", "--dtype",
                                                                                  "float32", "--enforce_eager"]  # fmt: skip
        # a fixed KV cache: no memory measurement, which fails when another process frees memory meanwhile; a small
        # utilisation: vLLM refuses to start unless that share of the GPU is free (the other track holds some)
        memory = ["--kv-cache-memory-bytes", "8G" if speed else "1G", "--gpu_memory_utilization",
                  "0.2" if speed else "0.05"]  # fmt: skip
        return self.python("-m", "trl.scripts.vllm_serve", "--model", model, "--host", "127.0.0.1", "--port",
                           str(port), *size, *memory, *GPU_SERVER)  # fmt: skip

    def start_server(self, phase: Phase, name: str, model: str, box: float, speed: bool) -> dict:
        port = free_port()
        command = self.server_command(model, port, speed)
        env = {**self.env(), "VLLM_SERVER_DEV_MODE": "1"}
        if (
            not speed
        ):  # Triton attention's float32 dot in full precision, as the trainer's greedy reference computes it
            env["TRITON_F32_DEFAULT"] = "ieee"
        log = open(self.logs / f"server_{name}.log", "a")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with self.lock:
            self.servers[name] = (process, command, url)
        start, end = time.time(), time.time() + box
        while not healthy(url):
            exited = process.poll() is not None
            stopped = phase.track == "side" and self.stop_side.is_set()
            if exited or stopped or time.time() > end:
                self.stop_server(name)
                why = (
                    "it exited" if exited else "the main track needed the GPU alone" if stopped else "its box ran out"
                )
                return {"status": "failed" if exited else "cut", "why": f"the server did not start: {why}"}
            time.sleep(1)
        return {"status": "ok", "url": url, "start_s": round(time.time() - start, 1)}

    def stop_server(self, name: str) -> None:
        with self.lock:
            entry = self.servers.pop(name, None)
        if entry is not None:
            kill_group(entry[0])

    def url(self, name: str) -> str:
        return self.servers[name][2]

    # ---- tracks -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        side = threading.Thread(target=self.track, args=("side",), daemon=True)
        side.start()
        self.track("main")
        side.join(timeout=5)
        for name in list(self.servers):
            self.stop_server(name)
        (self.stage / "runner.done").write_text(str(time.time()))

    def track(self, track: str) -> None:
        try:
            for phase in (p for p in PHASES if p.track == track):
                self.write(self.one(phase))
        finally:
            if track == "side":
                try:
                    with self.lock:
                        names = [n for n in self.servers if n.startswith("verdict")]
                    for name in names:
                        self.stop_server(name)
                finally:
                    self.side_over.set()

    def one(self, phase: Phase) -> dict:
        began = time.time()
        while not self.arrived(phase.needs):
            broken = [n for n in phase.needs if (self.stage / "failed" / n).exists()]
            if broken:
                return phase_result(phase, "failed", began, time.time(), 0, why=f"{broken} could not be unpacked")
            if time.time() > self.deadline or (phase.track == "side" and self.stop_side.is_set()):
                return phase_result(phase, "cut", began, time.time(), 0, why=f"never had {phase.needs}")
            time.sleep(1)
        if phase.track == "side" and self.stop_side.is_set():
            return phase_result(phase, "cut", began, time.time(), 0, why="the main track needed the GPU alone")
        grace = DRY_SIDE_GRACE_S if self.dry else SIDE_GRACE_S
        if phase.alone and not self.side_over.wait(timeout=grace):
            self.stop_side.set()
            self.side_over.wait()
        started = time.time()
        box = box_for(phase, self.dry, started, self.deadline, self.overrides)
        if box < 1:
            return phase_result(phase, "cut", started, started, box, why="no time left in the plan")
        try:
            outcome = getattr(self, f"phase_{phase.name}")(phase, box)
        except Exception as exc:  # noqa: BLE001 - a phase that cannot run is recorded; the plan goes on
            outcome = {"status": "failed", "why": f"{type(exc).__name__}: {exc}"}
        return phase_result(phase, outcome.pop("status"), started, time.time(), box, **outcome)

    def write(self, result: dict) -> None:
        path = self.results / f"{result['phase']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
        path.with_suffix(".tmp").replace(path)

    # ---- the side track: verdicts -------------------------------------------------------------------------------
    def phase_verdict_server(self, phase: Phase, box: float) -> dict:
        size = "hidden_size=64, num_heads=2" if self.dry else "hidden_size=256, num_heads=4"
        made = self.command(phase, self.python("-c", f"from trl_async.demo.tiny import save_tiny_model; "
                                                      f"save_tiny_model({self.tiny!r}, {size}); "
                                                      f"{self.make_tiny_fsdp2}"), box)  # fmt: skip
        if made["status"] != "ok":
            return made
        return self.start_server(phase, "verdict", self.tiny, box, speed=False)

    def phase_zero3(self, phase: Phase, box: float) -> dict:
        if "verdict" not in self.servers:
            return {"status": "skipped", "why": "the verdict server is not running"}
        config = json.loads((REPO / "recipes/accelerate/zero3_offload.json").read_text())
        # the norms stay on the GPU, the matrices' shards live on the CPU: mixed devices
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
        (self.stage / "zero3_offload_mixed.json").write_text(json.dumps(config))
        yaml = self.stage / "zero3_1proc.yaml"
        yaml.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                        f"  deepspeed_config_file: {self.stage / 'zero3_offload_mixed.json'}\n  zero3_init_flag: false\n"
                        f"num_machines: 1\nnum_processes: 1\nmachine_rank: 0\nuse_cpu: false\n")  # fmt: skip
        process, command, url = self.servers["verdict"]
        out = self.results / "zero3.verdict.json"
        argv = self.python("-m", "accelerate.commands.launch", "--config_file", str(yaml), "--main_process_port",
                           str(free_port()), str(HERE / "gpu_check.py"), "--out", str(out), "--model", self.tiny,
                           "--url", url, "--steps", "6", "--device", "cpu" if self.dry else "cuda")  # fmt: skip
        env = {
            **self.env(),
            "GPU_CHECK_RESTART": json.dumps(command),
            "GPU_CHECK_SERVER_PGID": str(process.pid),
            "VLLM_SERVER_DEV_MODE": "1",
            "TRITON_F32_DEFAULT": "ieee",
        }  # the restarted server's, as the first's
        outcome = self.command(phase, argv, box, env)
        pgid = Path(f"{out}.pgid")
        if pgid.exists():  # the restarted server: stopped with the side track
            with self.lock:
                self.servers["verdict_restarted"] = (_Group(int(pgid.read_text())), command, url)
        return with_verdict(outcome, out)

    # ---- the main track -----------------------------------------------------------------------------------------
    def phase_convert(self, phase: Phase, box: float) -> dict:
        if self.dry:
            return {"status": "ok", "model": self.model}
        log = self.logs / "convert.path"
        outcome = self.command(phase, ["bash", "-c", f"{sys.executable} -m trl_async.demo.pretrained > {log}"], box)
        if outcome["status"] == "ok":
            self.model = log.read_text().split()[-1]
        return {**outcome, "model": self.model}

    def phase_bench_server(self, phase: Phase, box: float) -> dict:
        if self.model is None:
            return {"status": "skipped", "why": "no model"}
        return self.start_server(phase, "bench", self.model, box, speed=True)

    def bench(self, phase: Phase, box: float, *args: str, steps: int = BENCH_STEPS) -> dict:
        argv = self.python(str(HERE / "gpu_bench.py"), "--name", "gpu_bench", "--model", self.model, "--steps",
                           str(2 if self.dry else steps), *args)  # fmt: skip
        if self.dry:
            argv += ["--smoke", "--server_python", str(REPO / ".venv-vllm" / "bin" / "python"),
                     "--server_args=--enforce-eager"]  # fmt: skip
        else:
            argv += [f"--server_args={shlex.join(GPU_SERVER)}"]
        return self.command(phase, argv, box)

    def on_bench_server(self, phase: Phase, box: float, *args: str) -> dict:
        if "bench" not in self.servers:
            return {"status": "skipped", "why": "the benchmark's server is not running"}
        return self.bench(phase, box, "--url", self.url("bench"), *args)

    def phase_generation_alone(self, phase: Phase, box: float) -> dict:
        return self.on_bench_server(phase, box, "--alone", "--configs")

    def phase_sync_server(self, phase: Phase, box: float) -> dict:
        if self.dry:
            return {"status": "skipped", "why": "GRPOTrainer's server mode needs vLLM and NCCL in the trainer"}
        return self.on_bench_server(phase, box, "--configs", "sync_server")

    def phase_async_s1(self, phase: Phase, box: float) -> dict:
        return self.on_bench_server(phase, box, "--configs", "async_s1")

    def phase_async_s2(self, phase: Phase, box: float) -> dict:
        return self.on_bench_server(phase, box, "--configs", "async_s2")

    def phase_free_gpu(self, phase: Phase, box: float) -> dict:
        self.stop_server("bench")
        left = self.left_after()
        return {"status": "ok" if not left else "failed", "left": left}

    def phase_sync_colocate(self, phase: Phase, box: float) -> dict:
        if self.dry:
            return {"status": "skipped", "why": "GRPOTrainer's colocate mode needs vLLM in the trainer"}
        return self.colocate(phase, box, "sync_colocate")

    def phase_async_colocate_s0(self, phase: Phase, box: float) -> dict:
        return self.colocate(phase, box, "async_colocate_s0")

    def colocate(self, phase: Phase, box: float, config: str) -> dict:
        """A colocated run, then nothing of it may be left holding the GPU."""
        outcome = self.bench(phase, box, "--configs", config, steps=COLOCATE_STEPS)
        left = self.left_after()  # the trainer's exit ends its server's group
        if left and outcome["status"] == "ok":
            outcome = {**outcome, "status": "failed"}
        return {**outcome, "left": left}

    def left_behind(self) -> list[str]:
        """What still holds the GPU (a rehearsal: vLLM servers of this plan's models still running)."""
        if not self.dry:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                                  "--format=csv,noheader"], capture_output=True, text=True, check=False).stdout  # fmt: skip
            return [line.strip() for line in out.splitlines() if line.strip()]
        out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False).stdout
        return [line.strip() for line in out.splitlines() if "vllm" in line and str(self.stage) in line]

    def left_after(self, wait_s: float = 15) -> list[str]:
        """``left_behind`` once the processes just stopped have had ``wait_s`` to go."""
        end = time.time() + wait_s
        while (left := self.left_behind()) and time.time() < end:
            time.sleep(1)
        return left

    def phase_fsdp2(self, phase: Phase, box: float) -> dict:
        """accelerate's FSDP2 (the shipped recipe, one process) with the transformers workers on a tiny model of its
        own: a verdict (benchmarks/gpu_check.py), run beside the side track's."""
        end, tiny = time.time() + box, self.stage / "tiny_fsdp2"
        if not (self.stage / "tiny_fsdp2.done").exists():  # the side track makes it when it makes its own
            made = self.command(phase, self.python("-c", f"from trl_async.demo.tiny import save_tiny_model; "
                                                          f"{self.make_tiny_fsdp2}"), box)  # fmt: skip
            if made["status"] != "ok":
                return made
        out = self.results / "fsdp2.verdict.json"
        argv = self.python("-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes/accelerate/fsdp2.yaml"),
                           "--num_processes", "1", "--main_process_port", str(free_port()), str(HERE / "gpu_check.py"),
                           "--mode", "fsdp2", "--out", str(out), "--model", str(tiny), "--steps", "4",
                           "--device", "cpu" if self.dry else "cuda")  # fmt: skip
        return with_verdict(self.command(phase, argv, max(1.0, end - time.time())), out)

    def phase_transformers(self, phase: Phase, box: float) -> dict:
        argv = self.python(str(HERE / "continuous_batching.py"), "--model", self.model)
        argv += (["--device", "cpu", "--slots", "2", "4", "--prompts", "6", "--max_new_tokens", "8"] if self.dry
                 else ["--device", "cuda", "--slots", "64", "256", "--prompts", "256", "--max_new_tokens", "40"])  # fmt: skip
        return self.command(phase, argv, box)

    def phase_worker_start(self, phase: Phase, box: float) -> dict:
        device = ["--device", "cpu" if self.dry else "cuda"]
        argv = self.python(str(HERE / "worker_start.py"), "--model", self.model, *device, "--steps", "4")
        return self.command(phase, argv, box)


def with_verdict(outcome: dict, out: Path) -> dict:
    """A verdict run's outcome with the verdict it wrote: "ok" only if it ran to the end and its verdict says ok."""
    if not out.exists():
        return {**outcome, "status": "failed" if outcome["status"] == "ok" else outcome["status"]}
    verdict = json.loads(out.read_text())
    return {**outcome, "status": "ok" if verdict.get("ok") and outcome["status"] == "ok" else "failed",
            "verdict": verdict}  # fmt: skip


class _Group:
    """A process group started elsewhere (a server restarted by a verdict), stopped like one of ours."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self) -> None:
        for _ in range(50):
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
