"""The CPU quick start runs as the docs print it (docs/quickstart.md), on the real model, offline."""

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_quickstart_page import PAGE, commands

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_the_cpu_quick_start_runs_as_printed():
    printed = [c for c in commands(PAGE.read_text()) if c.startswith("python ")]
    assert printed == ["python examples/quickstart_cpu.py"]
    # the page's install line (pip install -e ".[demo]") is the dev environment's already: what it adds is here
    assert importlib.util.find_spec("gguf") is not None
    argv = shlex.split(printed[0])
    env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout + done.stderr
    for shown in ("'rewards/correct/mean'", "'rewards/brief/mean'", "'async/staleness_mean'", "'is/ess'", "4/4"):
        assert shown in out, f"{shown} not printed:\n{out[-3000:]}"
