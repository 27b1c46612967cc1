"""The agentic regime of benchmarks/throughput.py: multi-turn episodes of 1-4 turns with a slow, long-tailed tool.

A tiny tool-calling model (trl_async.demo.tiny.build_tool_model) is fitted so that prompt "Task k...: look up k keys"
makes k calls of ``lookup`` (one per turn, each after the previous result) and then says "Done!": episodes of k + 1
turns, k = 0..3. ``lookup`` sleeps a log-normal time (median 100 ms, p99 2 s: sigma = ln(20) / 2.326), like a search
API or a sandbox, and uses no CPU meanwhile. Both trainers get the same tool, seeded per run.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from pathlib import Path

from datasets import Dataset

MEDIAN_S, P99_S = 0.1, 2.0
SIGMA = math.log(P99_S / MEDIAN_S) / 2.326  # the 99th percentile of a standard normal is 2.326
CALLS = (0, 1, 2, 3)  # tool calls per episode: 1 to 4 turns
IDS = "abcd"
LOOKUP_DOC = """
    Looks up a key.

    Args:
        key: The key to look up.

    Returns:
        The value stored under the key.
    """


def _call(key: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'key': key}})}\n</tool_call>"


def episodes() -> dict[str, list[tuple[str, list[str]]]]:
    return {
        f"Task {k}{i}: look up {k} keys.": [(_call(f"{i}{r}"), ["ok"]) for r in range(k)] + [("Done!", [])]
        for k in CALLS
        for i in IDS
    }


def make_lookup(seed: int):
    """``lookup`` with a seeded, thread-safe log-normal latency; ``lookup.spans`` keeps each call's (start, end)."""
    rng, lock = random.Random(seed), threading.Lock()
    spans: list[tuple[float, float]] = []

    def lookup(key: str) -> str:
        with lock:
            delay = rng.lognormvariate(math.log(MEDIAN_S), SIGMA)
        start = time.time()
        time.sleep(min(delay, 10.0))
        with lock:
            spans.append((start, time.time()))
        return "ok"

    lookup.__doc__ = LOOKUP_DOC
    lookup.spans = spans
    return lookup


def make_model(path: str) -> str:
    from trl_async.demo.tiny import build_tool_model

    return str(build_tool_model(Path(path), episodes(), [make_lookup(0)], fit_steps=800, hidden_size=128))


def dataset() -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in episodes()])


def done_reward(completions, **kwargs) -> list[float]:
    return [float(bool(c) and c[-1].get("content") == "Done!") for c in completions]


def task(model_dir: str, seed: int) -> dict:
    """What ``throughput.run_one`` needs for this regime."""
    from transformers import PreTrainedTokenizerFast

    return dict(
        dataset=dataset(), reward=done_reward, tools=[make_lookup(seed)],
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        settings=dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=128, temperature=0.7,
                      learning_rate=1e-5, beta=0.0, logging_steps=1, report_to=[], bf16=False, use_cpu=True,
                      save_strategy="no", disable_tqdm=True, gradient_checkpointing=False),
    )  # fmt: skip
