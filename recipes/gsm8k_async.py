"""GRPO on GSM8K with asynchronous rollouts: TRL's `trl grpo` script shape, with AsyncGRPOTrainer.

Arguments are parsed by TRL's ``TrlParser`` into (script args, ``AsyncGRPOConfig``, ``ModelConfig``); every field
can come from the YAML file given with ``--config`` and be overridden on the command line.

    # 1 GPU (the trainer and the rollout worker share it)
    accelerate launch recipes/gsm8k_async.py --config recipes/configs/gsm8k_async.yaml --rollout_device cuda:0

    # 8 GPUs: 7 train with DeepSpeed ZeRO-3, the rollout worker generates on the 8th (rank 0 hosts the workers and
    # syncs the weights from the shards)
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 7 \\
        recipes/gsm8k_async.py --config recipes/configs/gsm8k_async.yaml --rollout_device cuda:7

    # separate vLLM server GPUs: one server per GPU (6 and 7) behind the same queue, ZeRO-3 training on GPUs 0-5,
    # weights pushed over NCCL by vLLM's weight-transfer engine (the servers must serve the model being trained)
    CUDA_VISIBLE_DEVICES=6 trl-async-vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000 &
    CUDA_VISIBLE_DEVICES=7 trl-async-vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8001 &
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 6 \\
        recipes/gsm8k_async.py --config recipes/configs/gsm8k_async.yaml --rollout_backend vllm \\
        --rollout_vllm_urls http://localhost:8000 http://localhost:8001

    # offline: a local JSON/JSONL file with `question` and `answer` columns (GSM8K's format)
    python recipes/gsm8k_async.py --config recipes/configs/gsm8k_async.yaml --dataset_path data/gsm8k_train.jsonl

    # offline on 2 CPU cores: the same code path on SmolLM2-135M-Instruct (the default model when none is given) and
    # the local arithmetic word problems (trl_async.demo.arithmetic), held-out greedy accuracy at every evaluation
    python recipes/gsm8k_async.py --config recipes/configs/arithmetic_cpu.yaml

    # the same on a code task (trl_async.demo.code_task): write small Python functions, rewarded by the fraction of their
    # tests that pass when run in the sandbox (trl_async.sandbox); held-out pass rate before training and at every
    # evaluation
    python recipes/gsm8k_async.py --config recipes/configs/code_cpu.yaml

With ``--task arithmetic`` or ``--task code`` the data, rewards and held-out evaluation are ``trl_async.demo.arithmetic``'s
or ``trl_async.demo.code_task``'s instead of GSM8K's.

GSM8K's rewards: ``correctness`` (1 if the last number of the completion equals the reference answer after "####")
and ``format`` (1 if the completion ends with "#### <number>"). Both only parse strings with regular expressions;
nothing generated is executed or evaluated. The code task's reward executes generated code, in the sandbox only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate import PartialState
from datasets import load_dataset
from transformers.hf_argparser import string_to_bool
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.demo import arithmetic, code_task
from trl_async.demo.evaluation import GreedyAccuracyCallback
from trl_async.demo.pretrained import smollm2_135m_instruct
from trl_async.hardware.precision import described_precision, recipe_precision
from trl_async.reporting.progress import print_summary, run_summary, samples_per_step
from trl_async.sandbox.rewards import CodeExecutionReward

SYSTEM_PROMPT = (
    "Solve the math problem. Think step by step, then give the final answer on the last line as '#### <number>'."
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)\s*$")


@dataclass
class GSM8KArguments(ScriptArguments):
    dataset_name: str | None = field(
        default="openai/gsm8k", metadata={"help": "Hub dataset (ignored with --dataset_path)"}
    )
    dataset_config: str | None = field(default="main", metadata={"help": "Hub dataset configuration"})
    dataset_path: str | None = field(
        default=None, metadata={"help": "Local JSON/JSONL file with `question` and `answer` columns (offline use)"}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows"})
    task: str = field(
        default="gsm8k",
        metadata={
            "help": "'gsm8k'; 'arithmetic': word problems generated locally (trl_async.demo.arithmetic), train and "
            "held-out templates, greedy held-out accuracy logged at every evaluation; 'code': small Python functions "
            "(trl_async.demo.code_task), scored by running their tests in the sandbox, held-out pass rate"
        },
    )
    heldout_size: int = field(default=64, metadata={"help": "Held-out problems for --task arithmetic or code"})


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def reference_answer(answer: str) -> str:
    """GSM8K's reference: the text after the last '####'."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion  # conversational or plain


def correctness(completions, solution, **kwargs) -> list[float]:
    """1.0 when the completion's last number equals the reference answer, else 0.0."""
    rewards = []
    for completion, ref in zip(completions, solution, strict=True):
        numbers = _NUMBER.findall(_text(completion))
        got, want = (_to_number(numbers[-1]) if numbers else None), _to_number(ref)
        rewards.append(1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion ends with '#### <number>'."""
    return [1.0 if _FINAL.search(_text(c).strip()) else 0.0 for c in completions]


def load_gsm8k(args: GSM8KArguments):
    if args.dataset_path:
        data = load_dataset("json", data_files=args.dataset_path, split="train")
    else:
        data = load_dataset(args.dataset_name, args.dataset_config, split=args.dataset_train_split)
    if args.max_train_samples is not None:
        data = data.select(range(min(args.max_train_samples, len(data))))

    def to_prompt(row):
        return {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
            "solution": reference_answer(row["answer"]),
        }

    return data.map(to_prompt, remove_columns=data.column_names)


def training_device(argv: list[str]) -> str:
    """The device the run will train on, read before parsing (``use_cpu`` from the command line, else from the
    ``--config`` file): the precision default depends on it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--use_cpu", type=string_to_bool, nargs="?", const=True)
    known, _ = pre.parse_known_args(argv)
    use_cpu = known.use_cpu
    if use_cpu is None and known.config:
        use_cpu = bool((yaml.safe_load(Path(known.config).read_text()) or {}).get("use_cpu", False))
    return "cpu" if use_cpu or not torch.cuda.is_available() else "cuda"


def make_parser(argv: list[str] | None = None) -> TrlParser:
    """The recipe's parser for ``argv`` (default: the command line). ``bf16`` defaults to on only where the
    training device computes bf16 natively, else float32 (trl_async.hardware.precision); a config file's ``bf16:`` or
    ``--bf16`` on the command line overrides it."""
    parser = TrlParser((GSM8KArguments, AsyncGRPOConfig, ModelConfig))
    parser.set_defaults(bf16=recipe_precision(training_device(sys.argv[1:] if argv is None else argv))[0])
    return parser


def main(script_args: GSM8KArguments, training_args: AsyncGRPOConfig, model_args: ModelConfig) -> dict:
    if script_args.task not in ("gsm8k", "arithmetic", "code"):
        raise ValueError(f"--task {script_args.task!r}: choose 'gsm8k', 'arithmetic' or 'code'")
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    device = "cpu" if training_args.use_cpu or not torch.cuda.is_available() else "cuda"
    precision = described_precision(training_args.bf16, training_args.fp16, device)
    if PartialState().is_main_process:
        print(f"precision: {precision}", flush=True)
    model = model_args.model_name_or_path or smollm2_135m_instruct()
    if script_args.task in ("arithmetic", "code"):
        task = arithmetic if script_args.task == "arithmetic" else code_task
        dataset = task.make_split("train", script_args.max_train_samples or 512, seed=training_args.seed)
        heldout = task.make_split("heldout", script_args.heldout_size, seed=training_args.seed)
        if task is arithmetic:
            rewards, score = [arithmetic.correctness_reward, arithmetic.format_reward], arithmetic.correctness_reward
        else:
            rewards = [CodeExecutionReward()]  # the fraction of the row's tests passed, run in the sandbox
            score = rewards[0]
    else:
        dataset, heldout, rewards = load_gsm8k(script_args), None, [correctness, format_reward]
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=heldout,
        peft_config=get_peft_config(model_args),
    )
    accuracy = before = None
    if heldout is not None:
        accuracy = GreedyAccuracyCallback(trainer, heldout, score)
        trainer.add_callback(accuracy)
        if script_args.task == "code":
            before = accuracy.measure()  # the pass rate before training
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    seconds = time.perf_counter() - start
    trainer.save_model(training_args.output_dir)
    # torch's documented shutdown (destroys the process group: the last distributed call); on an abort at exit that it
    # does not prevent under ZeRO-3 on gloo, see the README's "Distributed training"
    trainer.accelerator.end_training()
    if not trainer.accelerator.is_main_process:
        return {}
    processes = trainer.accelerator.num_processes
    summary = run_summary(trainer.state.log_history, seconds, samples_per_step(training_args, processes))
    summary["precision"] = precision
    if accuracy is not None and accuracy.history:
        summary["heldout_greedy_accuracy"] = dict(accuracy.history)  # step -> accuracy, at every evaluation
    if before is not None:
        summary["heldout_greedy_accuracy_before"] = before
    print_summary(f"{script_args.task} async GRPO ({model})", summary)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*make_parser().parse_args_and_config())
