"""The pipeline simulator, out of sample: predict the dedicated-device runs from shared-core runs (issue 21 item 4).

Inputs come only from runs where generation and training share the cores, never from the dedicated runs themselves:
- G (one generation batch on one core) and T (one training step on one core) from TRL's GRPOTrainer with one thread
  (``sync_1thread``: it alternates the two phases on one core, so each phase's time is a one-core rate), per step,
  the first step left out (start-up);
- the weight sync S from AsyncGRPOTrainer's shared-core runs (``async``: ``async/weight_sync_s``).
The simulator (``simulate.py``) then runs AsyncGRPOTrainer's scheduling rules with one worker generating whole
batches (``rollout_batch_groups`` defaults to the batch with one worker) at ``max_staleness`` 0 (the synchronous
schedule, ``ded_sync``) and 1 (``ded_async_s1``), and its seconds per step are compared with the measured steady
seconds per step (first step left out) of the dedicated runs.

What the model does not know, and so what the error holds: the two cores slowing each other (a shared L3 and memory
bandwidth), the worker's generate loop (per-token μ) against GRPOTrainer's, and sampled lengths differing by run.

    python benchmarks/time_to_accuracy.py --configs ded_sync ded_async_s1 sync async sync_1thread --seeds 0 1 2 \\
        --steps 10 --eval_every 0 --reference ded_sync --name dedicated_32_shared
    python benchmarks/predict_dedicated.py --from_json benchmarks/results/dedicated_32_shared.json
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
    """Pure: the one-core phase costs (seconds) from shared-core runs, steps after the first: G = GRPOTrainer's
    generation per step, T = the rest of its step (scoring, the loss's forward and backward), S = the async
    trainer's weight publish per step. Steps are TRL's ``step_time`` (``training_step``): the optimizer step and the
    callbacks after it fall outside, on both the fed and the measured side."""
    gens = [g for r in one_thread_runs for g in r["generate_s"][1:]]
    rests = [s - g for r in one_thread_runs for s, g in zip(r["step_s"][1:], r["generate_s"][1:], strict=True)]
    syncs = [r["weight_sync_s_mean"] for r in async_runs if r.get("weight_sync_s_mean") is not None]
    return {
        "G_s": statistics.fmean(gens),
        "T_s": statistics.fmean(rests),
        "S_s": statistics.fmean(syncs) if syncs else 0.0,
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


def compare(runs: list[dict]) -> tuple[dict, list[dict]]:
    by_config: dict[str, list[dict]] = {}
    for r in runs:
        by_config.setdefault(r["config"], []).append(r)
    rates = shared_core_rates(by_config["sync_1thread"], by_config.get("async", []))
    rows = []
    for config, eta in PREDICTED.items():
        if config not in by_config:
            continue
        measured, predicted = steady_s_per_step(by_config[config]), predict(rates, eta)
        rows.append({"config": config, "max_staleness": eta, "seeds": len(by_config[config]),
                     "measured_s_per_step": measured, "predicted_s_per_step": predicted,
                     "error": predicted / measured - 1})  # fmt: skip
    if len(rows) >= 2:  # the speed-up, predicted and measured (what a user sizes a cluster by)
        base = rows[0]
        for row in rows[1:]:
            row["measured_speedup"] = base["measured_s_per_step"] / row["measured_s_per_step"]
            row["predicted_speedup"] = base["predicted_s_per_step"] / row["predicted_s_per_step"]
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
    report.write_json(cli.name, {"source": cli.from_json, "rates": rates, "rows": rows})
    header = ["config", "max_staleness", "seeds", "measured s/step", "predicted s/step", "error",
              "measured speed-up", "predicted speed-up"]  # fmt: skip
    table = report.markdown_table(header, [[r["config"], r["max_staleness"], r["seeds"], r["measured_s_per_step"],
                                            r["predicted_s_per_step"], f"{r['error']:+.1%}",
                                            r.get("measured_speedup", "-"), r.get("predicted_speedup", "-")]
                                           for r in rows])  # fmt: skip
    said = (
        f"Fed only shared-core rates from `{Path(cli.from_json).name}`: G = {rates['G_s']:.2f} s (GRPOTrainer's "
        f"generation per step on one thread), T = {rates['T_s']:.2f} s (the rest of its step), S = "
        f"{rates['S_s']:.3f} s (the async trainer's publish). Steady seconds per step (first step left out)."
    )
    report.update_readme(cli.name, f"{said}\n\n{table}\n\n![{cli.name}](results/{cli.name}.png)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_s_per_step"] for r in rows], 0.4, label="measured (dedicated runs)")
    ax.bar(
        [x + 0.2 for x in xs], [r["predicted_s_per_step"] for r in rows], 0.4, label="simulator (shared-core rates)"
    )
    ax.set_xticks(list(xs), [r["config"] for r in rows])
    ax.set(ylabel="steady s/step", title="dedicated device: predicted out of sample")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path(cli.name), dpi=110)
    print(table)


if __name__ == "__main__":
    main()
