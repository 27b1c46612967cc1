"""Shared output for benchmarks: a JSON file, a markdown table spliced into benchmarks/RESULTS.md, a PNG path."""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

import torch

from trl_async.hardware.precision import cpu_name, device_precision

HERE = Path(__file__).resolve().parent
# BENCH_RESULTS_DIR: write results (and the RESULTS.md tables) there instead, e.g. a rehearsal that must leave the
# committed results alone
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
RESULTS_MD = RESULTS / "RESULTS.md" if os.environ.get("BENCH_RESULTS_DIR") else HERE / "RESULTS.md"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container or taskset may allow fewer than the host)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine() -> dict:
    native = device_precision("cpu")
    return {"cpu": cpu_name(), "native_bf16": native.bf16, "precision_why": native.why, "cpu_count": usable_cores(),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__}  # fmt: skip


def measured_on(section: str) -> str:
    """The line every table starts with, from the machine recorded in ``results/<section>.json`` (this machine
    where there is none): the CPU decides what is fast (bf16 is 26x slower where it is emulated)."""
    path = RESULTS / f"{section}.json"
    recorded = json.loads(path.read_text()).get("machine", {}) if path.exists() else machine()
    if "cpu" not in recorded:  # results written before the CPU was recorded: all were measured on the AMX Xeon
        return "*Measured on an Intel Xeon with AMX-BF16 (native bf16), before the CPU was recorded (2026-11-29/30).*"
    bf16 = "native bf16" if recorded["native_bf16"] else f"no native bf16: {recorded['precision_why']}"
    return f"*Measured on {recorded['cpu']} ({bf16}).*"


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def update_readme(section: str, body: str) -> None:
    """Replace the text between ``<!-- section:begin -->`` and ``<!-- section:end -->`` in ``RESULTS.md`` (appended
    if absent)."""
    readme = RESULTS_MD
    text = readme.read_text() if readme.exists() else "# Benchmark results\n"
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    block = f"{begin}\n{measured_on(section)}\n\n{body.strip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def png_path(name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{name}.png"
