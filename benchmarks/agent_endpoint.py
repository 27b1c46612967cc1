"""Agents through the OpenAI-compatible endpoint (trl_async/agents): the same agent, written against the `openai`
client, with a slow, long-tailed tool, trained asynchronously and under a synchronous schedule.

The task and the tool are the agentic regime's (agentic_task.py): a tiny model fitted to call ``lookup`` k times
(k = 0..3, one call per turn) and then say "Done!"; ``lookup`` sleeps a log-normal time (median 100 ms, p99 2 s) and
uses no CPU meanwhile. The agent sends every turn to the endpoint and runs the tool itself. The synchronous schedule
is AsyncGRPOTrainer at ``max_staleness=0``: the next batch's episodes start only once the step before has trained,
as in a synchronous trainer; ``max_staleness=2`` lets them run while the trainer trains. Equal work: the same steps,
batch, data, tool latencies (seeded per repeat) and agent. Runs alternate between the two, repeat by repeat.

    python benchmarks/agent_endpoint.py                      # 2 repeats of 6 measured steps (after 2 warm-up)
    python benchmarks/agent_endpoint.py --repeats 1 --steps 3

Writes results/agent_endpoint.json and .png, and prints the table. Tokens/s counts the sampled (trained) completion
tokens of the measured steps per second of wall clock; steps/s the measured steps per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import agentic_task  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = {"sync (max_staleness=0)": 0, "async (max_staleness=2)": 2}


def make_agent(lookup):
    from openai import OpenAI
    from transformers.utils import get_json_schema

    tools = [get_json_schema(lookup)]

    def agent(prompt, base_url: str) -> float:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        messages = list(prompt)
        for _ in range(6):
            message = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = lookup(**json.loads(call.function.arguments))
                except (TypeError, ValueError) as exc:
                    result = str({"error": str(exc)})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return float((message.content or "") == "Done!")

    return agent


def run_one(model_dir: str, staleness: int, steps: int, warmup: int, seed: int) -> dict:
    import torch
    from transformers import TrainerCallback

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.agents import agent_reward, agent_rollout

    torch.set_num_threads(1)
    task = agentic_task.task(model_dir, seed)
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = AsyncGRPOConfig(output_dir=out, max_steps=warmup + steps, max_staleness=staleness, seed=seed,
                               rollout_trajectory_file="traj.jsonl", **task["settings"])  # fmt: skip
        rollout = agent_rollout(make_agent(task["tools"][0]), timeout_s=60, keep=0)
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=agent_reward, args=args, train_dataset=task["dataset"],
                                   processing_class=task["processing_class"], rollout_func=rollout,
                                   callbacks=[StepEnds()])  # fmt: skip
        trainer.train()
        rows = [json.loads(x) for x in (Path(out) / "traj.jsonl").read_text().splitlines()]
    wall = ends[-1] - ends[warmup - 1]
    tokens = sum(sum(r.get("tool_mask") or [1] * len(r["completion_ids"])) for r in rows if r["step"] >= warmup)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"staleness": staleness, "seed": seed, "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
            "tokens_per_s": tokens / wall, "tokens": tokens, "reward_mean": statistics.fmean(rewards),
            "abandoned_groups": max((h.get("async/abandoned_groups", 0) for h in trainer.state.log_history),
                                    default=0)}  # fmt: skip


def table(summary: list[dict]) -> str:
    lines = ["| schedule | steps/s | tokens/s | vs sync |", "|---|---|---|---|"]
    sync = summary[0]
    for s in summary:
        lines.append(f"| {s['schedule']} | {s['steps_per_s']:.3f} | {s['tokens_per_s']:.1f} | "
                     f"{s['steps_per_s'] / sync['steps_per_s']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "agent_endpoint"))
    cli = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        model_dir = agentic_task.make_model(f"{folder}/model")
        runs = [run_one(model_dir, staleness, cli.steps, cli.warmup, seed)
                for seed in range(cli.repeats) for staleness in SCHEDULES.values()]  # fmt: skip
    summary = []
    for name, staleness in SCHEDULES.items():
        mine = [r for r in runs if r["staleness"] == staleness]
        summary.append({"schedule": name, "staleness": staleness, "repeats": len(mine),
                        "steps_per_s": statistics.median(r["steps_per_s"] for r in mine),
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine)})  # fmt: skip
    import torch

    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },  # fmt: skip
        "command": "python benchmarks/agent_endpoint.py " + " ".join(sys.argv[1:]),
        "elapsed_s": time.time() - started,
        "tool": {"median_s": agentic_task.MEDIAN_S, "p99_s": agentic_task.P99_S},
        "summary": summary,
        "runs": runs,
    }
    Path(cli.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([s["schedule"] for s in summary], [s["steps_per_s"] for s in summary])
    ax.set(xlabel="steps per second (median over repeats)",
           title=f"an openai-client agent, slow tool, {cli.steps} steps x {cli.repeats} repeats")  # fmt: skip
    fig.tight_layout()
    fig.savefig(Path(cli.out).with_suffix(".png"), dpi=120)
    print(table(summary))


if __name__ == "__main__":
    main()
