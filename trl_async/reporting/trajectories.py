"""An audit trail of what was trained on: one JSON line per completion consumed.

Each line: optimizer ``step``, ``group_id``, ``worker_id`` (the lane: a worker process's or vLLM server's index),
``prompt_index``, ``prompt`` (the dataset's prompt, text or messages), ``completion`` (decoded text), ``rewards`` (every
reward function's value, ``null`` for None/NaN), ``advantage``, ``staleness``, ``versions`` (the policy version of each
completion token), and the token ids with the behaviour log-probs, enough to recompute every importance weight:
``prompt_ids``, ``completion_ids`` and ``logprobs`` (mu of each completion token under the distribution it was sampled
from; ``null`` where the backend gave none). Multi-turn episodes (``tools``) add ``tool_mask`` (0 for tool-result
tokens, whose log-prob is a 0.0 placeholder) and ``turns``: per assistant turn, the versions its tokens were sampled
with, its length and worker, and its ``tool_calls`` (name, arguments, result cut to 500 characters, failed) with
``rolled_back`` when the results would have overflowed ``max_completion_length``. Generated text is written as data
only; nothing here interprets it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path


def trajectory_records(
    rows: Sequence, advantages: Sequence[float], step: int, reward_names: Sequence[str], tokenizer
) -> list[dict]:
    """``rows`` are ``(ScoredGroup, completion index)`` pairs in batch order, ``advantages`` one value per row."""
    if len(rows) != len(advantages):
        raise ValueError(f"{len(rows)} rows but {len(advantages)} advantages")
    records = []
    for (scored, j), advantage in zip(rows, advantages, strict=True):
        group = scored.group
        rewards = {
            name: (None if math.isnan(v) else v)
            for name, v in zip(reward_names, scored.rewards[j].tolist(), strict=True)
        }
        record = {
            "step": step,
            "group_id": group.group_id,
            "worker_id": group.lane_id,
            "prompt_index": group.prompt_index,
            # environments: each episode's own prompt (with its reset observation); the data may have no "prompt"
            "prompt": group.row_prompts[j] if group.row_prompts else scored.row.get("prompt"),
            "completion": tokenizer.decode(list(group.completion_ids[j]), skip_special_tokens=True),
            "rewards": rewards,
            "advantage": float(advantage),
            "staleness": scored.staleness,
            "versions": list(group.versions[j]),
            "prompt_ids": list(group.row_prompt_ids[j] if group.row_prompt_ids else group.prompt_ids),
            "completion_ids": list(group.completion_ids[j]),
            "logprobs": [None if v is None or math.isnan(v) else v for v in group.logprobs[j]],
        }
        if group.tool_mask:
            record["tool_mask"] = list(group.tool_mask[j])
            record["turns"] = list(group.turns[j]) if group.turns else []  # rollout_func's env_mask: no turns
        records.append(record)
    return records


def append_jsonl(path: str | Path, records: Sequence[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
