"""The pipeline simulator, out of sample: predict the dedicated-device runs from shared-core runs .

Inputs come only from runs without pinning, never from the dedicated runs themselves. Two sets of one-core phase
costs, each fed to the simulator in turn:
- **the worker engine's** (``async_1+1``: AsyncGRPOTrainer on the two cores unpinned, trainer and worker one thread
  each): G = one rollout worker generate call (the batch's groups in one call), T = the trainer's step less its wait
  for data, S = its weight publish. The engine that generates in the dedicated runs is the one measured. On two
  cores the kernel gives each one-thread process a core of its own, so ``async_1+1`` is ``ded_async_s1`` without the
  pinning: only the ``ded_sync`` prediction (the other schedule) is out of sample for this source;
- **GRPOTrainer's** (``sync_1thread``: it alternates the two phases on one thread): G = its generation per step, T =
  the rest of its step, S from the shared-core async runs. Kept to show what the wrong G costs: TRL generates with
  the float32 weights under autocast, the worker with bf16 weights where bf16 is native, about twice as fast.
Steps are after the first (start-up and the pipeline's fill), as are generate calls.
The simulator (``simulate.py``) then runs AsyncGRPOTrainer's scheduling rules with one worker generating whole
batches (``rollout_batch_groups`` defaults to the batch with one worker) at ``max_staleness`` 0 (the synchronous
schedule, ``ded_sync``) and 1 (``ded_async_s1``), and its seconds per step are compared with the measured steady
seconds per step of the dedicated runs.

What the model does not know, and so what the error holds: the two cores slowing each other differently when each
process is pinned (a shared L3 and memory bandwidth), and sampled lengths differing by run (``--fixed_length`` makes
every completion the budget's length, so every generate call does the same work).

    python benchmarks/time_to_accuracy.py --configs ded_sync ded_async_s1 async_1+1 --seeds 0 1 2 --steps 6 \\
        --eval_every 0 --reference ded_sync --max_completion_length 128 --fixed_length --name dedicated_128_worker
    python benchmarks/predict_dedicated.py --from_json benchmarks/results/dedicated_128_worker.json \\
        --name dedicated_128_worker_prediction
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

PREDICTED = {"ded_sync": 0, "ded_async_s1": 1, "ded_async_s2": 2}  # dedicated configuration -> max_staleness
GROUPS_PER_STEP = 2  # the task's batch: 16 completions = 2 prompts x 8


def shared_core_rates(one_thread_runs: list[dict], async_runs: list[dict]) -> dict:
    """Pure: GRPOTrainer's one-core phase costs (seconds), steps after the first: G = its generation per step, T =
    the rest of its step (scoring, the loss's forward and backward), S = the async trainer's weight publish per step.
    Steps are TRL's ``step_time`` (``training_step``): the optimizer step and the callbacks after it fall outside, on
    both the fed and the measured side."""
    gens = [g for r in one_thread_runs for g in r["generate_s"][1:]]
    rests = [s - g for r in one_thread_runs for s, g in zip(r["step_s"][1:], r["generate_s"][1:], strict=True)]
    syncs = [r["weight_sync_s_mean"] for r in async_runs if r.get("weight_sync_s_mean") is not None]
    return {
        "G_s": statistics.fmean(gens),
        "T_s": statistics.fmean(rests),
        "S_s": statistics.fmean(syncs) if syncs else 0.0,
    }


def worker_engine_rates(one_plus_one_runs: list[dict]) -> dict:
    """Pure: the one-core phase costs (seconds) of AsyncGRPOTrainer's own engines, from unpinned runs with one
    thread a side: G = a rollout worker's generate call (calls after each run's first), T = the trainer's step less
    its wait for data (steps after the first), S = its weight publish per step."""
    for r in one_plus_one_runs:
        if r.get("eval_s") or len(r.get("worker_generate_s") or []) < 2 or r.get("weight_sync_s_mean") is None:
            raise ValueError(
                f"{r['config']} seed {r.get('seed')}: a rate source needs at least 2 worker generate calls, a weight "
                "sync and no evaluations (workers are stopped during one, mid-call): run it with --eval_every 0"
            )
    gens = [g for r in one_plus_one_runs for g in r["worker_generate_s"][1:]]
    rests = [s - w for r in one_plus_one_runs for s, w in zip(r["step_s"][1:], r["trainer_wait_s"][1:], strict=True)]
    return {
        "G_s": statistics.fmean(gens),
        "T_s": statistics.fmean(rests),
        "S_s": statistics.fmean(r["weight_sync_s_mean"] for r in one_plus_one_runs),
    }


def steady_s_per_step(runs: list[dict]) -> float:
    """Pure: mean seconds per step over the runs' steps after the first (start-up and the pipeline's fill)."""
    return statistics.fmean(s for r in runs for s in r["step_s"][1:])


def predict(rates: dict, max_staleness: int, steps: int = 40) -> float:
    """The simulator's steady seconds per step for one worker on its own device and a one-core trainer."""
    from simulate import Pipeline, simulate

    pipeline = Pipeline(workers=1, gen_call_s=rates["G_s"], groups_per_call=GROUPS_PER_STEP,
                        train_step_s=rates["T_s"], groups_per_step=GROUPS_PER_STEP, max_staleness=max_staleness,
                        sync_s=rates["S_s"])  # fmt: skip
    return simulate(pipeline, steps=steps).seconds_per_step(warmup=steps // 4)


# where the rates come from (an unpinned configuration) -> what measured them
SOURCES = {
    "async_1+1": "the rollout worker's generate calls and AsyncGRPOTrainer's step, one thread a side",
    "sync_1thread": "GRPOTrainer's generation and the rest of its step, one thread",
}


def compare(runs: list[dict]) -> tuple[dict, list[dict]]:
    """Per available source of rates (``SOURCES``), the rates; per dedicated configuration, the measured steady
    seconds per step and each source's prediction and error."""
    by_config: dict[str, list[dict]] = {}
    for r in runs:
        by_config.setdefault(r["config"], []).append(r)
    rates = {}
    if "async_1+1" in by_config:
        rates["async_1+1"] = worker_engine_rates(by_config["async_1+1"])
    if "sync_1thread" in by_config:
        async_runs = by_config.get("async", []) + by_config.get("async_1+1", [])  # S: the async trainer's publish
        rates["sync_1thread"] = shared_core_rates(by_config["sync_1thread"], async_runs)
    if not rates:
        raise ValueError(
            f"no rate source among the runs: run one of {list(SOURCES)} beside the dedicated configurations"
        )
    rows = []
    for config, eta in PREDICTED.items():
        if config not in by_config:
            continue
        row = {"config": config, "max_staleness": eta, "seeds": len(by_config[config]),
               "measured_s_per_step": steady_s_per_step(by_config[config])}  # fmt: skip
        for source, r in rates.items():
            predicted = row[f"predicted_s_per_step[{source}]"] = predict(r, eta)
            row[f"error[{source}]"] = predicted / row["measured_s_per_step"] - 1
        rows.append(row)
    if len(rows) >= 2:  # the speed-up, predicted and measured (what a user sizes a cluster by)
        base = rows[0]
        for row in rows[1:]:
            row["measured_speedup"] = base["measured_s_per_step"] / row["measured_s_per_step"]
            for source in rates:
                key = f"predicted_s_per_step[{source}]"
                row[f"predicted_speedup[{source}]"] = base[key] / row[key]
    return rates, rows


def main() -> None:
    import report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--from_json", required=True, help="a time_to_accuracy.py results JSON with the configurations above"
    )
    parser.add_argument("--name", default="dedicated_prediction")
    cli = parser.parse_args()
    source = json.loads(Path(cli.from_json).read_text())
    rates, rows = compare(source["runs"])
    # the machine is the one that measured the source runs (this script only computes)
    report.write_json(cli.name, {"machine": source["machine"], "source": cli.from_json, "rates": rates, "rows": rows})
    header = ["config", "max_staleness", "seeds", "measured s/step"]
    for source in rates:
        header += [f"predicted s/step ({source})", f"error ({source})"]
    header += ["measured speed-up"] + [f"predicted speed-up ({source})" for source in rates]
    lines = []
    for r in rows:
        line = [r["config"], r["max_staleness"], r["seeds"], r["measured_s_per_step"]]
        for source in rates:
            line += [r[f"predicted_s_per_step[{source}]"], f"{r[f'error[{source}]']:+.1%}"]
        line += [r.get("measured_speedup", "-")] + [r.get(f"predicted_speedup[{source}]", "-") for source in rates]
        lines.append(line)
    table = report.markdown_table(header, lines)
    fed = "; ".join(f"`{source}` ({SOURCES[source]}): G = {r['G_s']:.2f} s, T = {r['T_s']:.2f} s, S = {r['S_s']:.3f} s"
                    for source, r in rates.items())  # fmt: skip
    said = (f"Fed only shared-core rates from `{Path(cli.from_json).name}`, per source: {fed}. Steady seconds per "
            "step (first step left out).")  # fmt: skip
    report.update_readme(cli.name, f"{said}\n\n{table}\n\n![{cli.name}](results/{cli.name}.png)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, width = range(len(rows)), 0.8 / (1 + len(rates))
    ax.bar(list(xs), [r["measured_s_per_step"] for r in rows], width, label="measured (dedicated runs)")
    for i, source in enumerate(rates, start=1):
        ax.bar([x + i * width for x in xs], [r[f"predicted_s_per_step[{source}]"] for r in rows], width,
               label=f"simulator, {source} rates")  # fmt: skip
    ax.set_xticks(list(xs), [r["config"] for r in rows])
    ax.set(ylabel="steady s/step", title="dedicated device: predicted out of sample")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path(cli.name), dpi=110)
    print(table)


if __name__ == "__main__":
    main()
