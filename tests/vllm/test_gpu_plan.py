"""The GPU plan rehearsed end to end on a CPU (benchmarks/gpu_plan.py, --dry-run): stand-in pieces cut into four
calls, each call a process, the runner in a session of its own, both tracks, vLLM CPU servers started as `trl
vllm-serve` starts them, and every phase under its box. One phase is planted to overrun its box: it is cut, and
every phase after it still runs and returns its results. The rehearsal runs in the background while other tests run
(tests/vllm_server.py, ``REHEARSAL_BOXES``); this test reads what it returned."""

import json
import subprocess
import tarfile
from pathlib import Path


def test_the_gpu_plan_runs_end_to_end_on_a_cpu_and_an_overrun_phase_is_cut_while_the_rest_goes_on(
    gpu_plan_rehearsal,
):
    work = gpu_plan_rehearsal
    plan = json.loads((work / "out4" / "plan.json").read_text())
    status = {name: result["status"] for name, result in plan["phases"].items()}
    assert plan["done"]
    assert status == {
        "verdict_server": "ok",
        "zero3": "ok",
        "convert": "ok",
        "bench_server": "ok",
        "generation_alone": "ok",
        "sync_server": "skipped",  # GRPOTrainer's vLLM modes need vLLM in the trainer's environment: not on a CPU
        "async_s1": "ok",
        "async_s2": "cut",  # the planted overrun
        "free_gpu": "ok",
        "sync_colocate": "skipped",
        "async_colocate_s0": "ok",
        "transformers": "ok",
        "worker_start": "ok",
        "fsdp2": "ok",
    }, json.dumps(plan["phases"], indent=1)[-4000:]
    phases = plan["phases"]
    assert phases["async_s2"]["why"] == "its box of 4 s ran out" and phases["async_s2"]["elapsed_s"] < 10

    # the verdicts: ZeRO-3 (one process) pushed to a server that was killed, restarted and re-attached, whose
    # greedy output then equals the trained model's
    verdict = phases["zero3"]["verdict"]
    assert verdict["ok"] and all(verdict["greedy_matches"]) and len(verdict["reattached"]) == 1
    assert verdict["steps"] == 6 and verdict["zero3_params"] > 0 and verdict["greedy_moved"]
    # FSDP2 (one process, the shipped recipe) with the transformers workers: every parameter sharded, several buckets
    # per sync, every adoption verified, the last published weights the gathered ones, every trained tensor moved,
    # every ratio 1 at staleness 0 and none from a missing log-prob
    fsdp2 = phases["fsdp2"]["verdict"]
    assert fsdp2["ok"] and fsdp2["fsdp_version"] == 2 and fsdp2["sharded_params"] == fsdp2["params"] > 0
    assert fsdp2["compared"] == fsdp2["params"] and not fsdp2["mismatches"] and not fsdp2["unmoved"]
    assert fsdp2["verified_adoptions"] >= 4 and fsdp2["buckets_per_sync"] > 1 and fsdp2["behaviour_nan"] == 0

    # the calls: the model, last to travel, arrived with call 4; each piece was unpacked once, when complete
    calls = plan["calls"]
    assert [c["call"] for c in calls] == [1, 2, 3, 4]
    unpacked = {name: c["call"] for c in calls for name in c["unpacked_s"]}
    assert unpacked["model"] == 4 and set(unpacked) == {"vllm", "wheels", "model"}
    # the side track began before the model had arrived, the main track's speed phases after the side track ended
    assert phases["verdict_server"]["started"] < calls[3]["began"]
    assert phases["generation_alone"]["started"] >= phases["zero3"]["started"] + phases["zero3"]["elapsed_s"]

    # what came back: at most 8 files; the benchmark's runs that finished, the cut one absent
    out = work / "out4"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"plan.json", "logs.tgz", "gpu_bench.json", "worker_start.json"} <= set(files)
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert set(bench["summary"]) == {"async_s1", "async_colocate_s0"} and bench["generation_alone_s"] > 0
    # at max_staleness 0 every sample comes from the weights being trained: its ratio is 1
    assert all(abs(s["ratio_mean"] - 1) < 0.01 for s in bench["runs"]["async_colocate_s0"]["steps"])
    with tarfile.open(out / "logs.tgz") as tar:
        logs = set(tar.getnames())
    assert {"zero3.log", "fsdp2.log", "server_verdict.log", "server_bench.log", "runner.log"} <= logs

    # nothing of the plan is left running: no server, no runner, no cut phase's processes
    assert not Path(f"/proc/{(work / 'stage' / 'runner.pid').read_text().strip()}").exists()
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(work) not in left, [line for line in left.splitlines() if str(work) in line]
