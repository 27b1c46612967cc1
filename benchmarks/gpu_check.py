"""GPU check of the vLLM backend (run by benchmarks/gpu_check.sh). Each mode trains a few asynchronous steps on one GPU
and writes a JSON verdict to the path given as the first argument:

- ``trl_serve``: a DeepSpeed ZeRO-3 trainer configured with GRPOTrainer's own fields (``use_vllm=True``,
  ``vllm_mode='server'``, ``vllm_server_base_url``) against a server started by TRL's ``trl vllm-serve``; the weight
  transport is read from the server. The server's greedy output must then equal the trained model's.
- ``zero3_reattach``: the same, with ``rollout_vllm_urls``; after step 2 the server is killed (SIGKILL to its process
  group, ``GPU_CHECK_SERVER_PGID``) and started again on its port with ``GPU_CHECK_RESTART`` (a JSON command line).
  Its lane waits; the next publish opens a new NCCL group with it, pushes the current weights, and only then gives it
  work. The greedy check runs on the restarted server, so it checks the weights that came over the new group. The
  restarted server's process-group id is written to ``<out>.pgid`` for the caller to stop it.
- ``zero3_offload``: ``offload_param: cpu``: shards off the GPU take DeepSpeed's gathered path; greedy check as above.
- ``colocate``: one process, ``use_vllm=True, vllm_mode='colocate'``: the trainer starts its own server on its GPU,
  trains, and stops it; the verdict requires the importance ratio near 1 (the pushed weights reached the server) and
  that no process of the server is left on the GPU afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.engines.vllm.client import VLLMServer
from trl_async.weights.policy import shard_resident


def reward(completions, **kwargs):
    return [c.count("a") / 8 for c in completions]


class KillAndRestart(TrainerCallback):
    """After step 2: SIGKILL the server's process group, start it again with the same command (its own group)."""

    def __init__(self, command: list[str], pgid: int, out_path: str) -> None:
        self.command, self.pgid, self.out_path = command, pgid, out_path

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        os.killpg(self.pgid, signal.SIGKILL)
        time.sleep(5)  # its port and GPU memory are released with its processes
        log = open(self.out_path + ".restarted.log", "w")
        server = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with open(self.out_path + ".pgid", "w") as f:
            f.write(str(server.pid))


def gathered_state(trainer) -> dict:
    """The trained weights on the main process, ZeRO-3 shards gathered (DeepSpeed's engine is ``model_wrapped``)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    state = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_tensor"):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p])
        else:
            gather = contextlib.nullcontext()
        with gather:
            state[name] = p.detach().float().cpu().clone()
    return state


def gpu_processes() -> list[int]:
    """PIDs of every process holding memory on the GPU (nvidia-smi)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    return [int(x) for x in out.split() if x.strip().isdigit()]


def main(out_path: str, model_dir: str, mode: str, url: str | None, steps: int) -> None:
    restart = json.loads(os.environ["GPU_CHECK_RESTART"]) if mode == "zero3_reattach" else None
    engine = {
        "trl_serve": dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url),
        "colocate": dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                         vllm_max_model_length=256,
                         rollout_vllm_server_args=["--enforce-eager", *os.environ.get("GPU_CHECK_SERVER_ARGS", "").split()]),
    }.get(mode, dict(rollout_backend="vllm", rollout_vllm_urls=[url]))  # fmt: skip
    args = AsyncGRPOConfig(
        output_dir="/tmp/gpu_check_out",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        bf16=False,
        save_strategy="no",
        beta=0.0,
        max_steps=steps,
        max_staleness=0 if mode == "colocate" else 1,  # colocate: every ratio must then be 1 (the pushed weights)
        vllm_server_timeout=300,
        # the only server is down while it restarts (a CUDA vLLM server starts in ~1-2 min): wait for it
        **({"rollout_vllm_retry_s": 600} if restart else {}),
        **engine,
    )
    dataset = Dataset.from_list([{"prompt": f"q{i}:"} for i in range(32)])
    callbacks = [KillAndRestart(restart, int(os.environ["GPU_CHECK_SERVER_PGID"]), out_path)] if restart else []
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                               callbacks=callbacks)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    sharded = [p for p in trainer.model_wrapped.parameters() if hasattr(p, "ds_tensor")]
    off_device = sum(not shard_resident(p) for p in sharded)  # shards the flat path cannot send: DeepSpeed gathers them
    state = gathered_state(trainer)
    logs = trainer.state.log_history
    staleness = [h["async/staleness_max"] for h in logs if "async/staleness_max" in h]
    sync = [h["async/weight_sync_s"] for h in logs if "async/weight_sync_s" in h]
    ratios = [h["is/ratio_mean"] for h in logs if "is/ratio_mean" in h]
    backend = trainer.last_rollout_pool.backend
    reattached = backend.reattached
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    verdict = {
        "mode": mode,
        "steps": trainer.state.global_step,
        "wall_s": round(wall, 2),
        "staleness_max": max(staleness) if staleness else None,
        "weight_sync_s_median": sorted(sync)[len(sync) // 2] if sync else None,
        "is_ratio_mean": ratios,
        "zero3_params": len(sharded),
        "shards_off_device": off_device,
        "reattached": reattached,
        "transport": type(backend.pusher.sender).__name__,
    }
    ok = trainer.state.global_step == steps and staleness and max(staleness) <= args.max_staleness
    if mode == "colocate":
        servers = backend.owned
        left = [pid for pid in gpu_processes() if pid != os.getpid()]  # (a container may hide other PIDs: see below)
        free, total = torch.cuda.mem_get_info()
        others = (total - free - torch.cuda.memory_reserved()) / 2**30  # held by other processes (and our context)
        verdict["server_exit_codes"] = [s.process.returncode for s in servers]
        verdict["gpu_processes_left"] = left
        verdict["gpu_gib_not_ours"] = round(others, 2)  # the server held vllm_gpu_memory_utilization=0.3 of the GPU
        ok = ok and servers and all(s.process.poll() is not None for s in servers) and not left and others < 4
        ok = ok and all(abs(r - 1) < 0.05 for r in ratios)
    else:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # else from_pretrained partitions it (ZeRO-3's zero.Init): every tensor of size 0
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        model.load_state_dict(state, strict=False)
        server = VLLMServer(url)
        matches = []
        for prompt in ([5, 6, 7, 8, 9], [20, 3, 11]):
            expected = model.generate(torch.tensor([prompt]).cuda(), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None)  # fmt: skip
            got = server.generate(prompt, {"n": 1, "max_tokens": 16, "temperature": 0.0, "logprobs": 0,
                                           "ignore_eos": True})  # fmt: skip
            matches.append(list(got[0].token_ids) == expected[0, len(prompt) :].tolist())
        verdict["greedy_matches"] = matches
        ok = ok and all(matches) and (not restart or [r["url"] for r in reattached] == [url])
    verdict["ok"] = bool(ok)
    print(json.dumps(verdict))
    with open(out_path, "w") as f:
        json.dump(verdict, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] or None, int(sys.argv[5]))
