"""The GPU verdicts of benchmarks/gpu_plan.py, each a 1-process run configured with GRPOTrainer's own fields
(``--mode``):

``zero3`` (the side track): DeepSpeed ZeRO-3 with parameter offload (``use_vllm=True``, ``vllm_mode='server'``,
``vllm_server_base_url``; the weight transport is read from the server) plus the time to wait for a lost server
(``rollout_vllm_retry_s``), against a server started by TRL's `trl vllm-serve`:

- *ZeRO-3 with offload*: the matrices' shards live on the CPU (DeepSpeed's gathered path), the small parameters on the
  GPU (the flat path): both kinds go out in each push;
- *re-attach*: after step 2 the server is killed (SIGKILL to its process group, ``GPU_CHECK_SERVER_PGID``) and started
  again on its port with ``GPU_CHECK_RESTART`` (a JSON command line). Its lane waits; the next publish opens a new
  transfer group with it, pushes the current weights, and only then gives it work. The restarted server's
  process-group id is written to ``<out>.pgid`` for the caller to stop it;
- *greedy equality*: after training, the restarted server's greedy output must equal the trained model's (the
  gathered ZeRO-3 weights), so the weights that came over the new group are the trainer's.

``fsdp2`` (the main track, beside the verdicts): accelerate's FSDP2 (``recipes/accelerate/fsdp2.yaml`` launched with
one process) with the transformers workers on the same GPU, at ``max_staleness`` 0:

- every parameter is a ``DTensor`` on the GPU; each sync gathers them in several buckets (``full_tensor()``);
- every adoption is verified by the workers' hash (``rollout_verify_weights``), and after training the last
  published weights equal accelerate's gathered state dict exactly, every trained tensor moved;
- every token's importance ratio is within 1e-3 of 1 (at staleness 0 the workers sample with the weights trained on),
  and no token lacks a log-prob.

With one process a shard is its whole tensor: this verdict covers FSDP2 on CUDA (NCCL, the device's DTensors, the
workers beside the trainer on one GPU), not the gather across ranks, which the 2-process CPU tests cover.

Either way the weights must have moved (else an equality proves nothing). The JSON verdict goes to ``--out``.
``--device cpu`` runs the same on a CPU (the plan's rehearsal: gloo instead of NCCL, nothing can be off a device, and
FSDP2 on CPU ranks needs the tests' patch of accelerate's gate, tests/distributed/fsdp_cpu.py).

    accelerate launch --config_file ZERO3_1PROC.yaml benchmarks/gpu_check.py --out V.json --model M \
        --url http://127.0.0.1:8000 --steps 6
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 1 benchmarks/gpu_check.py \
        --mode fsdp2 --out V.json --model M --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.engines.vllm.client import VLLMServer
from trl_async.weights.buckets import plan_buckets
from trl_async.weights.policy import policy_units, shard_resident


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
        launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith("TORCHELASTIC_")}
        server = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def common_fields(out_path: str, steps: int) -> dict:
    return dict(output_dir=out_path + ".run", per_device_train_batch_size=8, num_generations=4,
                max_completion_length=16, learning_rate=5e-2, logging_steps=1, report_to=[], bf16=False,
                save_strategy="no", beta=0.0, max_steps=steps)  # fmt: skip


def staleness_seen(logs: list[dict]) -> list[int]:
    return [h["async/staleness_max"] for h in logs if "async/staleness_max" in h]


def write_verdict(out_path: str, verdict: dict) -> None:
    print(json.dumps(verdict))
    with open(out_path, "w") as f:
        json.dump(verdict, f, indent=1)


def zero3(out_path: str, model_dir: str, url: str, steps: int, device: str) -> None:
    restart = json.loads(os.environ["GPU_CHECK_RESTART"])
    args = AsyncGRPOConfig(
        **common_fields(out_path, steps),
        max_staleness=1,
        vllm_server_timeout=300,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        rollout_vllm_retry_s=600,  # the only server is down while it restarts (about a minute on a GPU): wait for it
    )
    dataset = Dataset.from_list([{"prompt": f"q{i}:"} for i in range(32)])
    callbacks = [KillAndRestart(restart, int(os.environ["GPU_CHECK_SERVER_PGID"]), out_path)]
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                               callbacks=callbacks)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    sharded = [p for p in trainer.model_wrapped.parameters() if hasattr(p, "ds_tensor")]
    # shards the flat path cannot send: DeepSpeed gathers them
    off_device = sum(not shard_resident(p) for p in sharded)
    state = gathered_state(trainer)
    logs = trainer.state.log_history
    staleness = staleness_seen(logs)
    sync = [h["async/weight_sync_s"] for h in logs if "async/weight_sync_s" in h]
    ratios = [h["is/ratio_mean"] for h in logs if "is/ratio_mean" in h]
    backend = trainer.last_rollout_pool.backend
    reattached = backend.reattached
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    verdict = {
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
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained partitions it (ZeRO-3's zero.Init): every tensor of size 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompts = ([5, 6, 7, 8, 9], [20, 3, 11])

    def greedy() -> list[list[int]]:
        return [model.generate(torch.tensor([prompt], device=device), max_new_tokens=16, do_sample=False,
                               eos_token_id=None)[0, len(prompt) :].tolist() for prompt in prompts]  # fmt: skip

    before = greedy()
    model.load_state_dict(state, strict=False)
    expected = greedy()
    server = VLLMServer(url)
    matches = []
    for prompt, tokens in zip(prompts, expected, strict=True):
        got = server.generate(prompt, {"n": 1, "max_tokens": 16, "temperature": 0.0, "logprobs": 0,
                                       "ignore_eos": True})  # fmt: skip
        matches.append(list(got[0].token_ids) == tokens)
    verdict["greedy_matches"] = matches
    # the trained model answers otherwise than the initial one: else a server that never received a weight would match
    verdict["greedy_moved"] = before != expected
    # the restarted server re-attached, and on a GPU the offload really put shards off it (else the gathered path
    # was never taken)
    ok = ok and all(matches) and before != expected and [r["url"] for r in reattached] == [url]
    verdict["ok"] = bool(ok and (device == "cpu" or off_device > 0))
    write_verdict(out_path, verdict)


class KeepPublished(TrainerCallback):
    """The workers' last published weights, read as training ends, before the pool closes and releases them."""

    def __init__(self) -> None:
        self.trainer, self.weights = None, None

    def on_train_end(self, args, state, control, **kwargs):
        shared = self.trainer.rollout_pool.backend.weights
        self.weights = {n: t.clone() for n, t in shared.tensors.items()}


def fsdp2(out_path: str, model_dir: str, steps: int, device: str) -> None:
    from torch.distributed.tensor import DTensor

    if device == "cpu":  # accelerate turns FSDP on for accelerator devices only: the tests' patch opens its gate
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
        from fsdp_cpu import let_fsdp_run_on_cpu

        let_fsdp_run_on_cpu()
    args = AsyncGRPOConfig(
        **common_fields(out_path, steps),
        use_cpu=device == "cpu",
        max_staleness=0,
        rollout_verify_weights=True,
        weight_sync_bucket_mb=0.05,  # several buckets even for a tiny model: one gathered at a time
    )
    dataset = Dataset.from_list([{"prompt": f"q{i}:"} for i in range(32)])
    kept = KeepPublished()
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                               callbacks=[kept])  # fmt: skip
    kept.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    params = list(trainer.model_wrapped.parameters())
    sharded = [p for p in params if isinstance(p, DTensor)]
    full = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # a collective: every rank calls it
    logs = trainer.state.log_history
    staleness = staleness_seen(logs)
    lows = [h["is/ratio_min"] for h in logs if "is/ratio_min" in h]
    highs = [h["is/ratio_max"] for h in logs if "is/ratio_max" in h]
    nans = sum(h.get("is/behaviour_nan", 0) for h in logs)  # a token without a log-prob would count as ratio 1
    units = policy_units(trainer.accelerator.unwrap_model(trainer.model), False, "full")
    buckets = len(plan_buckets([u.nbytes for u in units], int(args.weight_sync_bucket_mb * 2**20)))
    pool = trainer.last_rollout_pool
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    published = kept.weights
    compared = [n for n in published if n in full]  # the rest are buffers (rotary frequencies), not trained
    mismatches = [n for n in compared if not torch.equal(published[n], full[n].to(published[n].dtype).cpu())]
    verdict = {
        "steps": trainer.state.global_step,
        "wall_s": round(wall, 2),
        "fsdp_version": trainer._dist.fsdp_version,
        "params": len(params),
        "sharded_params": len(sharded),
        "param_devices": sorted({p.device.type for p in params}),
        "staleness_max": max(staleness) if staleness else None,
        "is_ratio_min": lows,
        "is_ratio_max": highs,
        "behaviour_nan": nans,
        "buckets_per_sync": buckets,
        "verified_adoptions": pool.verified_adoptions,
        "compared": len(compared),
        "not_compared": [n for n in published if n not in full],
        "mismatches": mismatches,
        # every trained tensor moved: the equalities above compare trained weights, not the initial ones
        "unmoved": [n for n in compared if torch.equal(full[n].float().cpu(), initial[n])],
    }
    ok = (
        verdict["steps"] == steps
        and verdict["fsdp_version"] == 2
        and len(sharded) == len(params) > 0
        and verdict["param_devices"] == [device]
        and staleness
        and max(staleness) == 0
        and lows
        and all(abs(r - 1) < 1e-3 for r in lows + highs)
        and nans == 0
        and buckets > 1
        and verdict["verified_adoptions"] >= steps
        and len(compared) == len(params)
        and not mismatches
        and not verdict["unmoved"]
    )
    verdict["ok"] = bool(ok)
    write_verdict(out_path, verdict)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="zero3", choices=["zero3", "fsdp2"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", default=None, help="zero3: the verdict server")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    cli = parser.parse_args()
    if cli.mode == "zero3":
        zero3(cli.out, cli.model, cli.url, cli.steps, cli.device)
    else:
        fsdp2(cli.out, cli.model, cli.steps, cli.device)
