"""Run by tests/distributed/test_distributed.py under `accelerate launch` (2 processes, gloo): trains a few async steps, then
compares the workers' weights (the last published version) with the consolidated trainer weights."""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# a native abort (SIGABRT, SIGSEGV) in a rank leaves its C++ stack (torch's handler), then every thread's Python stack
# (faulthandler, enabled by the launching test's PYTHONFAULTHANDLER=1, which torch's handler chains to)
torch._C._set_print_stack_traces_on_fatal_signal(True)
from datasets import Dataset  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402


def reward(completions, **kwargs):
    return [sum(ch in "abc" for ch in c) / 6 for c in completions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--peft", action="store_true")
    parser.add_argument("--lora_sync", default="adapters", help="rollout_lora_sync with --peft")
    parser.add_argument("--use_cpu", action="store_true", help="DDP on CPU: accelerate's MULTI_CPU (gloo)")
    parser.add_argument("--stall_rank1", type=float, default=0.0, help="rank 1 sleeps this long before step 2")
    parser.add_argument("--vllm_url", default=None, help="generate on this vLLM server (weights pushed over gloo)")
    parser.add_argument("--reward_model", default=None, help="also score with this sequence-classification model")
    parser.add_argument("--max_staleness", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="save at step 2, then train to the end from there")
    parser.add_argument("--fsdp_on_cpu", action="store_true", help="FSDP on CPU ranks (tests/distributed/fsdp_cpu.py)")
    parser.add_argument("--control", action="store_true", help="then GRPOTrainer itself, in the same launch")
    parser.add_argument("--iterable", action="store_true", help="the prompts as an IterableDataset")
    cli = parser.parse_args()
    if cli.fsdp_on_cpu:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from fsdp_cpu import let_fsdp_run_on_cpu

        let_fsdp_run_on_cpu()
        cli.use_cpu = True  # CPU ranks over gloo, FSDP2 on them
    torch.set_num_threads(1)
    grpo_fields = dict(
        output_dir=os.path.join(os.path.dirname(cli.out), "run"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,  # global generation batch: 2 ranks x 4 rows = 2 groups, one per rank
        max_completion_length=6,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        ddp_backend="gloo",
        use_cpu=cli.use_cpu,
    )
    args = AsyncGRPOConfig(
        **grpo_fields,
        max_staleness=cli.max_staleness,
        rollout_lora_sync=cli.lora_sync,
        rollout_verify_weights=True,
        weight_sync_bucket_mb=0.05,  # several buckets even for the tiny model
        rollout_trajectory_file="traj.jsonl",  # per rank: rewards and advantages of its rows, checked by the test
    )
    if cli.vllm_url:
        args.rollout_backend, args.rollout_vllm_urls, args.rollout_verify_weights = "vllm", [cli.vllm_url], False
        args.max_completion_length = 8
    peft_config = None
    if cli.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ds = Dataset.from_list([{"prompt": f"p{i}:"} for i in range(16)])
    if cli.iterable:
        ds = ds.to_iterable_dataset()
    callbacks = []
    if cli.stall_rank1:
        import time

        from transformers import TrainerCallback

        class Stall(TrainerCallback):  # a rank that stops arriving (e.g. a stuck data loader or a deadlock)
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 1 and int(os.environ.get("RANK", 0)) == 1:
                    time.sleep(cli.stall_rank1)

        callbacks.append(Stall())
        args.rollout_timeout_s = 15.0
    from transformers import TrainerCallback

    kept = {}

    class KeepPublished(TrainerCallback):  # the workers' last weights, read before the pool closes and releases them
        def on_train_end(self, args, state, control, **kwargs):
            pool = trainer.rollout_pool
            if pool is not None and hasattr(pool.backend, "weights"):
                kept["weights"] = {n: t.clone() for n, t in pool.backend.weights.tensors.items()}
                base = getattr(pool.backend, "base", None)
                kept["base"] = {n: t.clone() for n, t in base.tensors.items()} if base is not None else None

    callbacks.append(KeepPublished())
    reward_funcs = [reward, cli.reward_model] if cli.reward_model else reward
    resume = None
    if cli.resume:  # a first run saves its checkpoint at step 2 and ends; the run below resumes from it
        import copy

        from transformers.trainer_utils import SaveStrategy

        first_args = copy.copy(args)
        first_args.max_steps, first_args.save_strategy, first_args.save_steps = 2, SaveStrategy.STEPS, 2
        first = AsyncGRPOTrainer(model=cli.model, reward_funcs=reward_funcs, args=first_args, train_dataset=ds,
                                 peft_config=peft_config)  # fmt: skip
        first.train()
        del first
        resume = True
    trainer = AsyncGRPOTrainer(
        model=cli.model, reward_funcs=reward_funcs, args=args, train_dataset=ds, peft_config=peft_config,
        callbacks=callbacks,
    )  # fmt: skip
    try:
        trainer.train(resume_from_checkpoint=resume)
    except RuntimeError as exc:
        if cli.stall_rank1 and trainer.accelerator.is_main_process:
            with open(cli.out, "w") as f:
                json.dump({"error": str(exc)}, f)
        raise

    # every rank's is/ metrics (gathered across ranks: the test checks that the ranks logged the same values)
    is_logs = [{k: v for k, v in h.items() if k.startswith("is/")} for h in trainer.state.log_history]
    with open(f"{cli.out}.is.rank{trainer.accelerator.process_index}", "w") as f:
        json.dump([h for h in is_logs if h], f)
    with open(f"{cli.out}.place.rank{trainer.accelerator.process_index}", "w") as f:  # where the rollout pool ran
        local = trainer.accelerator.local_process_index
        json.dump({"local_index": local, "pool": trainer.last_rollout_pool is not None}, f)
    full = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # collective: every rank calls it
    if trainer.accelerator.is_main_process:
        if cli.peft:  # independent reference: peft's own merge of a CPU copy holding the consolidated weights
            if cli.fsdp_on_cpu:  # an FSDP2 model cannot be copied: a fresh one (no ZeRO-3 here to partition it)
                from peft import get_peft_model
                from transformers import AutoModelForCausalLM

                reference_model = get_peft_model(AutoModelForCausalLM.from_pretrained(cli.model), peft_config)
            else:  # (from_pretrained under ZeRO-3 would partition it, a collective the other rank never joins)
                import copy

                reference_model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).cpu()
            for name, p in reference_model.named_parameters():
                p.data = full[name].clone() if name in full else p.data
            reference = dict(reference_model.merge_and_unload().state_dict())
        else:
            reference = full
        pool = trainer.last_rollout_pool
        if cli.vllm_url:
            write_vllm_result(cli, trainer, reference, pool)
            trainer.accelerator.wait_for_everyone()
            return
        published = kept["weights"]
        adapter_only = kept["base"] is not None
        per_version = sorted(published)  # what each version after the first sends
        if adapter_only:  # LoRA: the frozen base (sent once) with the last version's adapters merged, as a worker does
            from trl_async.weights.lora_merge import merged_weights

            published = merged_weights(pool.backend.specs[0].lora_merges, kept["base"], published)
        compared, mismatches = 0, []
        for name, tensor in published.items():
            if name in reference:
                compared += 1
                if not torch.allclose(tensor, reference[name].to(tensor.dtype), rtol=0, atol=1e-6 if cli.peft else 0):
                    mismatches.append(name)
        result = {
            **run_facts(trainer),
            "verified_adoptions": pool.verified_adoptions,
            "compared": compared,
            "expected": len(published),
            "mismatches": mismatches,
            "not_compared": [n for n in published if n not in reference],
            "adapter_only": adapter_only,
            "per_version": per_version,
            "workers_alive": [p.is_alive() for p in (lane.process for lane in pool.current_lanes)],
        }
        with open(cli.out, "w") as f:
            json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    if cli.control:
        control = grpo_trainer_control(grpo_fields, cli.model, ds)
        if trainer.accelerator.is_main_process:
            with open(cli.out) as f:
                result = json.load(f)
            with open(cli.out, "w") as f:
                json.dump({**result, "control": control}, f)


def grpo_trainer_control(grpo_fields: dict, model: str, dataset) -> dict:
    """GRPOTrainer itself under the same launch and GRPO configuration (2 steps): a set-up TRL trains in."""
    from torch.distributed.tensor import DTensor
    from trl import GRPOConfig, GRPOTrainer

    output_dir = os.path.join(os.path.dirname(grpo_fields["output_dir"]), "control")
    grpo_args = GRPOConfig(**{**grpo_fields, "max_steps": 2, "output_dir": output_dir})
    control = GRPOTrainer(model=model, reward_funcs=reward, args=grpo_args, train_dataset=dataset)
    control.train()
    params = list(control.model_wrapped.parameters())
    trained = control.accelerator.get_state_dict(control.model_wrapped)  # collective: every rank calls it
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    changed = sum(not torch.equal(trained[n], initial[n]) for n in trained if n in initial)
    return {"steps": control.state.global_step, "sharded": sum(isinstance(p, DTensor) for p in params),
            "params": len(params), "changed": changed}  # fmt: skip


def run_facts(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    params = list(trainer.model_wrapped.parameters())
    return {
        "zero_stage": trainer._dist.zero_stage,
        "fsdp_version": trainer._dist.fsdp_version,
        "sharded_params": [sum(isinstance(p, DTensor) for p in params), len(params)],
        "sharded_reward_params": [  # a reward model as GRPOTrainer prepared it
            sum(isinstance(p, DTensor) for p in f.parameters())
            for f in trainer.reward_funcs
            if hasattr(f, "parameters")
        ],
        "num_processes": trainer.accelerator.num_processes,
        "steps": trainer.state.global_step,
        "max_staleness_seen": max(h["async/staleness_max"] for h in logs),
    }


def write_vllm_result(cli, trainer, reference, pool):
    """The consolidated weights go to a file: the test compares the server's greedy output with them (building a
    model here would run DeepSpeed's ZeRO-3 init, a collective, on rank 0 alone)."""
    torch.save({k: v.float().cpu() for k, v in reference.items()}, os.path.join(os.path.dirname(cli.out), "final.pt"))
    result = {**run_facts(trainer), "server_version": pool.lane_versions}
    with open(cli.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # torch's documented shutdown
    # ... which does not end gloo's threads here: DeepSpeed holds its own reference to a world group (its
    # groups._WORLD_GROUP), and both groups' gloo threads (gloo_tcp_loop, pt_gloo_runloop) were still running after
    # destroy_process_group and a gc.collect(). They are torn down with the interpreter, where a rank aborted ~1 in
    # 35 ZeRO-3 launches (SIGABRT, "terminate called without an active exception", no Python frame left), after the
    # result was written. The result is on disk: leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
