"""One GPU, the real model: GRPOTrainer with vLLM against AsyncGRPOTrainer, equal work, end to end.

SmolLM2-135M-Instruct (``trl_async.demo.pretrained``) on the arithmetic word problems (``trl_async.demo.arithmetic``) with
room to reason (``max_completion_length`` 256), 16 prompts x 8 completions per optimizer step, bf16 autocast, the
same seed and steps for every configuration:

  sync_server     GRPOTrainer, use_vllm=True, vllm_mode='server', on the shared server (generate, then train)
  async_s1        AsyncGRPOTrainer with the same fields on the same server, max_staleness=1
  async_s2        the same at max_staleness=2
  sync_colocate   GRPOTrainer, vllm_mode='colocate': vLLM inside the training process, taking turns with it
  async_colocate  AsyncGRPOTrainer, vllm_mode='colocate': its own server beside the trainer, both at once
  async_colocate_s0  the same at max_staleness=0: the synchronous schedule, so against sync_colocate it measures
                  what the machinery costs (and every ratio must be 1)

Each configuration runs in its own process. Its clock starts when its first optimizer step ends: what comes before
(loading, an engine's start, CUDA graphs) differs between set-ups, is paid once per run, and is reported apart as
``first_step_s``. Reported per configuration: completion tokens trained per second, the median step time, the weight
sync per step (and its share of a step), the time to reach the synchronous server run's final reward (mean of its
last 5 steps; each run's reward smoothed over 5 steps), and the GPU's SM utilisation (``nvidia-smi dmon``) over the
clocked steps. The bound on one shared GPU is what each side leaves idle: G, the shared server generating one step's
completions alone (16 concurrent requests, n=8, median of 3), and T, one training step alone (``sync_server``'s
median step minus its own generation and weight sync); ``(G+T)/max(G,T)``.

    python benchmarks/gpu_bench.py --configs sync_server async_s1 async_s2      # results merged into one file
    python benchmarks/gpu_bench.py --configs sync_colocate async_colocate
    # against a server already running (benchmarks/gpu_plan.py starts it with TRL's `trl vllm-serve`), one
    # configuration at a time, G measured once:
    python benchmarks/gpu_bench.py --url http://127.0.0.1:8000 --alone --configs sync_server
    # on CPU, a smoke run of the harness (tiny model, vLLM CPU server in .venv-vllm, gloo):
    python benchmarks/gpu_bench.py --smoke --configs async_s1 async_colocate --name gpu_bench_smoke \\
        --server_python .venv-vllm/bin/python --server_args='--enforce-eager'

Writes benchmarks/results/<name>.{json,png} (``$BENCH_RESULTS_DIR`` instead, where set); an existing file is merged
into, so configurations run one at a time add up.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CONFIGS = {
    "sync_server": dict(kind="sync", mode="server"),
    "async_s1": dict(kind="async", mode="server", max_staleness=1),
    "async_s2": dict(kind="async", mode="server", max_staleness=2),
    "sync_colocate": dict(kind="sync", mode="colocate"),
    "async_colocate": dict(kind="async", mode="colocate", max_staleness=1),
    "async_colocate_s0": dict(kind="async", mode="colocate", max_staleness=0),
}
GPU = dict(prompts=16, completions=8, length=256, micro=32, memory=0.3, max_len=1024)
SMOKE = dict(prompts=2, completions=4, length=8, micro=8, memory=0.3, max_len=256)


def sizes(smoke: bool) -> dict:
    return SMOKE if smoke else GPU


def training_fields(cli, size: dict) -> dict:
    from trl_async.demo.arithmetic import TRAINING_SETTINGS

    per_step = size["prompts"] * size["completions"]
    return dict(output_dir=tempfile.mkdtemp(prefix="gpu_bench_"), learning_rate=TRAINING_SETTINGS["learning_rate"],
                temperature=TRAINING_SETTINGS["temperature"], beta=0.0, num_generations=size["completions"],
                per_device_train_batch_size=size["micro"], gradient_accumulation_steps=per_step // size["micro"],
                max_completion_length=size["length"], max_steps=cli.steps, seed=cli.seed, logging_steps=1,
                report_to=[], save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
                bf16=not cli.smoke, use_cpu=cli.smoke, vllm_server_timeout=600)  # fmt: skip


# ---- one configuration, in its own process -------------------------------------------------------------------------
class Timed:
    """Seconds spent in a method of an object, per optimizer step (wrapped in place)."""

    def __init__(self, owner, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def run_one(cli, name: str) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.arithmetic import correctness_reward, format_reward, make_split

    config, size = CONFIGS[name], sizes(cli.smoke)
    fields = training_fields(cli, size)
    if config["mode"] == "server":
        fields.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=cli.url)
    else:
        fields.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=size["memory"],
                      vllm_max_model_length=size["max_len"])  # fmt: skip
    if config["kind"] == "async":
        fields.update(max_staleness=config["max_staleness"])
        if config["mode"] == "colocate":
            fields.update(rollout_vllm_python=cli.server_python, rollout_vllm_server_args=cli.server_args)
        args, trainer_class = AsyncGRPOConfig(**fields), AsyncGRPOTrainer
    else:
        args, trainer_class = GRPOConfig(**fields), GRPOTrainer
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            entry = {"end": time.time()}
            if generate is not None:  # GRPOTrainer: its own generation and weight sync in this step
                entry.update(generate_s=generate.seconds, sync_s=sync.seconds)
                generate.seconds = sync.seconds = 0.0
            steps.append(entry)

    train = make_split("train", 1024, seed=cli.seed)
    trainer = trainer_class(model=cli.model, reward_funcs=[correctness_reward, format_reward], args=args,
                            train_dataset=train, callbacks=[Clock()])  # fmt: skip
    generate = sync = None
    if config["kind"] == "sync":
        generate, sync = Timed(trainer.vllm_generation, "generate"), Timed(trainer.vllm_generation, "sync_weights")
    began = time.time()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for entry, log in zip(steps, logs, strict=False):
        entry.update(reward=log["reward"], tokens=log["completions/mean_length"] * size["prompts"] * size["completions"],
                     weight_sync_s=log.get("async/weight_sync_s", entry.get("sync_s")),
                     trainer_wait_s=log.get("async/trainer_wait_s"), ratio_mean=log.get("is/ratio_mean"))  # fmt: skip
    pool = getattr(trainer, "last_rollout_pool", None)  # AsyncGRPOTrainer: which transport carried the weights
    sender = getattr(getattr(getattr(pool, "backend", None), "pusher", None), "sender", None)
    return {"config": name, "began": began, "steps": steps, "transport": type(sender).__name__ if sender else None}


# ---- the driver ----------------------------------------------------------------------------------------------------
def smoothed(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def summarise(run: dict, target: float | None, util: list[tuple[float, float]]) -> dict:
    """The clocked figures of one run (its steps after the first)."""
    steps = run["steps"]
    first_end, last_end = steps[0]["end"], steps[-1]["end"]
    clocked = steps[1:]
    wall = last_end - first_end
    durations = [b["end"] - a["end"] for a, b in zip(steps, steps[1:], strict=False)]
    syncs = [s["weight_sync_s"] for s in clocked if s.get("weight_sync_s") is not None]
    rewards = smoothed([s["reward"] for s in steps])
    reached = next((s["end"] - first_end for s, r in zip(steps, rewards, strict=True) if target is not None and r >= target
                    and s["end"] > first_end), None)  # fmt: skip
    window = [u for t, u in util if first_end <= t <= last_end]
    return {
        "config": run["config"],
        "first_step_s": round(first_end - run["began"], 2),
        "clocked_steps": len(clocked),
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(s["tokens"] for s in clocked) / wall, 1) if wall > 0 else None,
        "step_s_median": round(statistics.median(durations), 3) if durations else None,
        "weight_sync_s_median": round(statistics.median(syncs), 4) if syncs else None,
        "weight_sync_share": round(statistics.median(syncs) / statistics.median(durations), 4) if syncs and durations else None,
        "reward_last5": round(statistics.fmean(s["reward"] for s in steps[-5:]), 4),
        "time_to_target_s": None if reached is None else round(reached, 2),
        "sm_util_mean": round(statistics.fmean(window), 1) if window else None,
    }


def start_dmon(path: Path):
    try:
        return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-o", "DT"], stdout=open(path, "w"),
                                stderr=subprocess.DEVNULL)  # fmt: skip
    except FileNotFoundError:  # no NVIDIA driver (a CPU smoke run)
        return None


def read_dmon(path: Path) -> list[tuple[float, float]]:
    """(epoch seconds, SM %) from ``nvidia-smi dmon -s u -o DT`` (columns: date, time, gpu, sm, mem, ...)."""
    samples = []
    for line in path.read_text().splitlines() if path.exists() else ():
        parts = line.split()
        if len(parts) >= 4 and not line.startswith("#") and parts[3].isdigit():
            samples.append((datetime.strptime(f"{parts[0]} {parts[1]}", "%Y%m%d %H:%M:%S").timestamp(), float(parts[3])))
    return samples


def generation_alone(url: str, model: str, size: dict, seed: int) -> float:
    """G: seconds for the server to generate one step's completions with nothing else running (median of 3)."""
    from transformers import AutoTokenizer

    from trl_async.demo.arithmetic import TRAINING_SETTINGS, make_split
    from trl_async.engines.vllm.client import VLLMServer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = make_split("train", size["prompts"], seed=seed + 1)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # a BatchEncoding or ids
    server = VLLMServer(url)
    params = {"n": size["completions"], "temperature": TRAINING_SETTINGS["temperature"], "max_tokens": size["length"],
              "logprobs": 0, "detokenize": False}  # fmt: skip
    times = []
    for rep in range(3):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            bodies = [{"token_ids": p, "sampling_params": {**params, "seed": rep}} for p in prompts]  # its own weights
            list(pool.map(server.post_while_alive, ["/inference/v1/generate"] * len(bodies), bodies))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="gpu_bench")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (trl_async.demo.pretrained)")
    parser.add_argument("--smoke", action="store_true", help="CPU harness check: tiny model and sizes, gloo")
    parser.add_argument("--server_python", default=None, help="the vLLM server's Python (default: this one)")
    parser.add_argument("--server_args", default="", type=shlex.split,
                        help="more `vllm serve` arguments, one string: --server_args='--enforce-eager'")
    parser.add_argument("--url", default=None, help="a server already running, for the server configurations")
    parser.add_argument("--alone", action="store_true", help="with --url: measure G (generation alone) on it")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one configuration
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.run:
        Path(cli.out).write_text(json.dumps(run_one(cli, cli.run)))
        return
    from trl_async.engines.vllm.colocate import ColocatedServer, wait_for

    size = sizes(cli.smoke)
    if cli.model is None:
        if cli.smoke:
            from trl_async.demo.tiny import save_tiny_model

            cli.model = str(save_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=128, num_heads=2))
        else:
            from trl_async.demo.pretrained import smollm2_135m_instruct

            cli.model = smollm2_135m_instruct()
    work = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    results_path = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results") / f"{cli.name}.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"runs": {}}
    server = None
    transport, gpus = ("gloo", None) if cli.smoke else ("nccl", ["0"])
    dtype = "float32" if cli.smoke else "bfloat16"
    flags = ["--dtype", dtype, "--max-model-len", str(size["max_len"])] + cli.server_args
    if not cli.smoke:
        flags += ["--gpu-memory-utilization", str(size["memory"])]
    try:
        if cli.url and cli.alone:
            results["generation_alone_s"] = round(generation_alone(cli.url, cli.model, size, cli.seed), 3)
        elif any(CONFIGS[c]["mode"] == "server" for c in cli.configs) and not cli.url:
            started = time.perf_counter()
            server = ColocatedServer.start(cli.model, transport, flags, gpus, work / "server.log", cli.server_python)
            wait_for([server], 900)
            results["server_start_s"] = round(time.perf_counter() - started, 1)
            results["generation_alone_s"] = round(generation_alone(server.url, cli.model, size, cli.seed), 3)
        for name in cli.configs:
            out = work / f"{name}.json"
            dmon = start_dmon(work / f"{name}.dmon")
            command = [sys.executable, __file__, "--run", name, "--out", str(out), "--model", cli.model,
                       "--steps", str(cli.steps), "--seed", str(cli.seed), "--url", cli.url or (server.url if server else ""),
                       f"--server_args={shlex.join(cli.server_args)}"]  # fmt: skip
            command += ["--smoke"] if cli.smoke else []
            command += ["--server_python", cli.server_python] if cli.server_python else []
            print(f"== {name}", flush=True)
            done = subprocess.run(command, check=False)
            if dmon is not None:
                dmon.terminate()
            if done.returncode != 0 or not out.exists():
                results["runs"][name] = {"config": name, "error": f"exit status {done.returncode}"}
                continue
            results["runs"][name] = {**json.loads(out.read_text()), "util": read_dmon(work / f"{name}.dmon")}
    finally:
        if server is not None:
            server.stop()
    report(cli, size, results, results_path)


def report(cli, size: dict, results: dict, path: Path) -> None:
    runs = {n: r for n, r in results["runs"].items() if "steps" in r}
    sync = runs.get("sync_server")
    target = statistics.fmean(s["reward"] for s in sync["steps"][-5:]) if sync else None
    rows = {n: summarise(r, target, [tuple(u) for u in r.get("util", [])]) for n, r in runs.items()}
    bound = None
    if sync and results.get("generation_alone_s"):
        own = [s["generate_s"] + s["sync_s"] for s in sync["steps"][1:]]
        g, t = results["generation_alone_s"], rows["sync_server"]["step_s_median"] - statistics.median(own)
        bound = {"G_s": g, "T_s": round(t, 3), "bound": round((g + t) / max(g, t), 3)}
    best_sync = max((rows[n]["tokens_per_s"] or 0 for n in rows if CONFIGS[n]["kind"] == "sync"), default=None)
    for row in rows.values():
        row["vs_best_sync"] = round(row["tokens_per_s"] / best_sync, 3) if best_sync and row["tokens_per_s"] else None
    results.update(summary=rows, bound=bound, target_reward=target, sizes=size, steps=cli.steps, machine=machine())
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    plot(runs, path.with_suffix(".png"))
    print(json.dumps({"bound": bound, "summary": rows}, indent=1))


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for package in ("transformers", "trl", "vllm", "deepspeed", "accelerate"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed here
            info[package] = None
    return info


def plot(runs: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        steps = run["steps"]
        axis.plot([s["end"] - steps[0]["end"] for s in steps], smoothed([s["reward"] for s in steps]), label=name)
    axis.set_xlabel("seconds after the first step")
    axis.set_ylabel("train reward (mean of 5 steps)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
