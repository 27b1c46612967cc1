"""Cost of a weight push to a vLLM CPU server (rollout_backend="vllm", gloo transport), against the bound.

For each model size, one real vLLM CPU server (started with ``trl-async-vllm-serve``) receives ``--pushes``
full pushes of the same weights, as AsyncGRPOTrainer does at every weight sync: pause, start, gloo broadcast of the
buckets + the server's ``load_weights``, finish (label), cache reset, resume. The reference is the transport alone:
the same buckets broadcast over gloo to a plain receiver process, in the same run. Ratio = transport / full push
(1.0 = the push costs no more than moving the bytes). Writes results/vllm_push.json, a table in RESULTS.md and a PNG.

    python benchmarks/vllm_push.py            # ~4 min on 2 cores (three server starts)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import markdown_table, png_path, update_readme, write_json  # noqa: E402
from trl_async.demo.tiny import save_tiny_model  # noqa: E402
from trl_async.engines.vllm.client import VLLMServer  # noqa: E402
from trl_async.engines.vllm.weight_push.fan_out import free_port, update_info  # noqa: E402
from trl_async.engines.vllm.weight_push.gloo_wire import open_group, receive_buckets, send_buckets  # noqa: E402
from trl_async.engines.vllm.weight_push.pusher import VLLMWeightPusher  # noqa: E402
from trl_async.weights.policy import iter_policy_buckets, policy_specs  # noqa: E402

SIZES = {"0.4M": dict(hidden_size=128, num_layers=2, num_heads=2), "10M": dict(hidden_size=512, num_layers=4, num_heads=8),
         "42M": dict(hidden_size=1024, num_layers=4, num_heads=16)}  # fmt: skip
BUCKET = 8 << 20  # weight_sync_bucket_mb default


def _raw_receiver(port: int, info: dict, rounds: int) -> None:
    group = open_group("127.0.0.1", port, 1, 2, 120)
    for _ in range(rounds):
        for _bucket in receive_buckets(group, info["names"], info["dtype_names"], info["shapes"], BUCKET):
            pass


def raw_broadcast_s(model, rounds: int) -> list[float]:
    """The transport alone: the same buckets over gloo to a receiver that only unpacks them."""
    specs = policy_specs(model, persistent_only=True)
    port, ctx = free_port(), multiprocessing.get_context("spawn")
    child = ctx.Process(target=_raw_receiver, args=(port, update_info(specs), rounds))
    child.start()
    group = open_group("127.0.0.1", port, 0, 2, 120)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        send_buckets(
            group, iter_policy_buckets(model, lambda p: contextlib.nullcontext(), BUCKET, persistent_only=True)
        )
        times.append(time.perf_counter() - start)
    child.join(60)
    return times


def push_s(server: VLLMServer, model, rounds: int) -> list[float]:
    specs = policy_specs(model, persistent_only=True)
    pusher = VLLMWeightPusher([server], "gloo", BUCKET, 120, specs)
    times = []
    for version in range(rounds):
        buckets = iter_policy_buckets(model, lambda p: contextlib.nullcontext(), BUCKET, persistent_only=True)
        pusher.push(buckets, version, "keep")
        times.append(pusher.last_phases)
    return times


def collect(pushes_per_size: int) -> list[dict]:
    from tests.vllm_server import start_server

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, kwargs in SIZES.items():
            model_dir = save_tiny_model(Path(tmp) / label, **kwargs)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            params = sum(p.numel() for p in model.parameters())
            mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            server = start_server(str(model_dir), Path(tmp) / f"{label}.log")
            try:
                pushes = push_s(VLLMServer(server.url), model, pushes_per_size)[1:]  # the first includes warm-up
            finally:
                server.stop()
            raw = raw_broadcast_s(model, pushes_per_size)[1:]
            runs.append({"size": label, "params": params, "mb": mb, "push_phases_s": pushes, "raw_broadcast_s": raw})
    return runs


def row(run: dict) -> list:
    """One table row from a run's raw timings (medians in ms)."""
    pushes, raw = run["push_phases_s"], run["raw_broadcast_s"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    totals = [sum(p.values()) for p in pushes]
    phase = {k: med([p[k] for p in pushes]) * 1e3 for k in pushes[0]}
    return [run["size"], run["params"], round(run["mb"], 1), med(totals) * 1e3, phase["pause"], phase["send"],
            phase["reset_resume"], med(raw) * 1e3, med(raw) / med(totals)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--from_json", help="redo the table and plot from a results JSON (no runs)")
    args = parser.parse_args()
    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())["runs"]
        args.pushes = len(runs[0]["push_phases_s"]) + 1
    else:
        runs = collect(args.pushes)
    rows = [row(r) for r in runs]
    header = ["model", "params", "MB (fp32)", "push ms (median)", "pause", "start+send+load+finish", "reset+resume",
              "gloo broadcast ms", "ratio (broadcast / push)"]  # fmt: skip
    write_json("vllm_push", {"bucket_bytes": BUCKET, "runs": runs})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[3] for r in rows], 0.4, label="full push to vLLM (pause → resume)")
    ax.bar([i + 0.2 for i in x], [r[7] for r in rows], 0.4, label="gloo broadcast of the same buckets")
    ax.set_xticks(list(x), [f"{r[0]} ({r[2]:.0f} MB)" for r in rows])
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Weight push to a vLLM CPU server")
    fig.tight_layout()
    fig.savefig(png_path("vllm_push"), dpi=120)
    body = (
        "Weight push to a vLLM CPU server (`python benchmarks/vllm_push.py`): pause, gloo broadcast + the server's "
        f"`load_weights`, label, cache reset, resume (phase columns: medians in ms); median of {args.pushes - 1} "
        "pushes after a warm-up one, "
        "against the gloo broadcast of the same 8 MB buckets to a plain receiver, in the same run.\n\n"
        + markdown_table(header, rows)
        + "\n\n![vllm push](results/vllm_push.png)"
    )
    update_readme("vllm_push", body)
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
