"""Tiny demo: asynchronous GRPO on a tiny model built locally (no hub, no GPU), on a small verifiable task (about a
minute on 2 cores). The benchmarks that study the machinery use its task; the main job is cpu_demo.py (a real model).

Task ("spelling"): whatever the prompt (``"write ab:"`` ...), the verifier rewards completions that spell the target
word ``bead`` position by position; it only compares strings, nothing generated is executed. A randomly
initialised 2-layer model starts near 0 and gets it right within about a minute on 2 CPU cores. The script prints the
greedy reward over the prompts before and after training, and a summary of the run (staleness, drops, time).

Launch:
    python recipes/tiny_demo.py
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/tiny_demo.py --use_cpu false --ddp_backend gloo
    python recipes/tiny_demo.py --max_steps 200 --max_staleness 2 --rollout_weight_update decode_step
Any AsyncGRPOConfig field can be given on the command line (parsed with TRL's ``TrlParser``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import time  # noqa: E402

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import TrlParser  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.demo.tiny import save_tiny_model  # noqa: E402
from trl_async.reporting.progress import print_summary, run_summary, samples_per_step  # noqa: E402

TARGET = "bead"
VOCAB = "abcdefgh" + "write :"


def spelling_reward(prompts, completions, **kwargs) -> list[float]:
    """Verifier: the fraction of the target word's positions the completion gets right (1.0 = spelled exactly). It
    only compares strings; nothing generated is executed."""
    return [sum(a == b for a, b in zip(c, TARGET, strict=False)) / len(TARGET) for c in completions]


def make_dataset(n: int = 16) -> Dataset:
    return Dataset.from_list([{"prompt": f"write {'abcdefgh'[i % 8]}{'abcdefgh'[i // 8]}:"} for i in range(n)])


@torch.no_grad()
def greedy_reward(trainer: AsyncGRPOTrainer, prompts: list[str]) -> float:
    """Mean reward of greedy completions from the trainer's current weights. Collective under ZeRO-3 (TRL gathers
    the shards for generation), so every rank calls it."""
    tokenizer = trainer.processing_class
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(trainer.accelerator.device)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        was_training = model.training
        model.eval()
        out = model.generate(
            **batch, max_new_tokens=trainer.max_completion_length, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, synced_gpus=trainer._dist.is_zero3,
        )  # fmt: skip
        model.train(was_training)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].size(1) :], skip_special_tokens=True)
    return sum(spelling_reward(prompts, completions)) / len(prompts)


def main(args: AsyncGRPOConfig) -> dict:
    torch.set_num_threads(1)
    state = PartialState()
    work = os.path.abspath(args.output_dir)  # the same path on every rank under `accelerate launch`
    model_dir = os.path.join(work, "tiny-char-qwen2")
    with state.main_process_first():  # rank 0 builds the model; the others then load it
        if state.is_main_process:
            save_tiny_model(model_dir, hidden_size=64, num_layers=2, chars=VOCAB)
    dataset = make_dataset()
    prompts = list(dataset["prompt"])
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=spelling_reward, args=args, train_dataset=dataset)
    before = greedy_reward(trainer, prompts)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = greedy_reward(trainer, prompts)
    # torch's documented shutdown (destroys the process group: the last distributed call); on an abort at exit that it
    # does not prevent under ZeRO-3 on gloo, see the README's "Distributed training"
    trainer.accelerator.end_training()
    if not state.is_main_process:
        return {}
    summary = {
        "greedy_reward_before": round(before, 3),
        "greedy_reward_after": round(after, 3),
        "processes": state.num_processes,
        **run_summary(trainer.state.log_history, seconds, samples_per_step(args, state.num_processes)),
    }
    print_summary("trl_async tiny demo", summary)
    return summary


DEMO_DEFAULTS = dict(
    output_dir="outputs/tiny_demo",
    max_steps=600,
    learning_rate=1e-3,
    per_device_train_batch_size=32,
    num_generations=8,
    max_completion_length=len(TARGET),
    temperature=1.5,
    beta=0.0,
    logging_steps=100,
    save_strategy="no",
    report_to=[],
    bf16=False,
    use_cpu=True,
    gradient_checkpointing=False,
    max_staleness=1,
    num_rollout_workers=1,
    seed=0,
)

if __name__ == "__main__":
    parser = TrlParser(AsyncGRPOConfig)
    parser.set_defaults(**DEMO_DEFAULTS)
    (config,) = parser.parse_args_and_config()
    main(config)
