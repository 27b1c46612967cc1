"""GPU check of the vLLM backend (run by benchmarks/gpu_check.sh): a DeepSpeed ZeRO-3 trainer pushes its weights to a
CUDA vLLM server over vLLM's NCCL weight-transfer engine and trains a few asynchronous steps; then the server's greedy
output must equal the trained model's. Writes a JSON verdict to the path given as the first argument.

With ``GPU_CHECK_RESTART`` set (a JSON list: the server's command line), the server is killed after step 2 (SIGKILL
to its process group, whose id is ``GPU_CHECK_SERVER_PGID``) and started again on its port with that command: its
lane waits, and at the next publish the backend opens a new NCCL group with it, pushes the current weights and only
then gives it work (issue 24's re-attach over NCCL). The verdict then also requires the re-attach, and the final
greedy check runs on the restarted server, so it checks the weights that came over the new group. The restarted
server's process-group id is written to ``<out>.pgid`` for the caller to stop it."""

from __future__ import annotations

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
from trl_async.sync.policy import shard_resident


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


def main(out_path: str, model_dir: str, url: str, steps: int) -> None:
    restart = json.loads(os.environ["GPU_CHECK_RESTART"]) if os.environ.get("GPU_CHECK_RESTART") else None
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
        max_staleness=1,
        rollout_backend="vllm",
        rollout_vllm_urls=[url],
        rollout_vllm_weight_transport="nccl",
        vllm_server_timeout=300,
        # the only server is down while it restarts (a CUDA vLLM server starts in ~1-2 min): wait for it
        **({"rollout_vllm_retry_s": 600} if restart else {}),
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
    state = trainer.accelerator.get_state_dict(trainer.model)  # ZeRO-3: gathered on the main process
    staleness = [h["async/staleness_max"] for h in trainer.state.log_history if "async/staleness_max" in h]
    sync = [h["async/weight_sync_s"] for h in trainer.state.log_history if "async/weight_sync_s" in h]
    reattached = trainer.last_rollout_pool.backend.reattached
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    server = VLLMServer(url)
    matches = []
    for prompt in ([5, 6, 7, 8, 9], [20, 3, 11]):
        expected = model.generate(torch.tensor([prompt]).cuda(), max_new_tokens=16, do_sample=False, eos_token_id=None)
        got = server.generate(
            prompt, {"n": 1, "max_tokens": 16, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        )
        matches.append(list(got[0].token_ids) == expected[0, len(prompt) :].tolist())
    verdict = {
        "steps": trainer.state.global_step,
        "wall_s": round(wall, 2),
        "staleness_max": max(staleness) if staleness else None,
        "weight_sync_s_median": sorted(sync)[len(sync) // 2] if sync else None,
        "greedy_matches": matches,
        "zero3_params": len(sharded),
        "shards_off_device": off_device,
        "reattached": reattached,
        "ok": trainer.state.global_step == steps and all(matches) and max(staleness) <= 1
        and (not restart or [r["url"] for r in reattached] == [url]),
    }
    print(json.dumps(verdict))
    with open(out_path, "w") as f:
        json.dump(verdict, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 4)
