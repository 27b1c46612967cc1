"""The import layers of docs/architecture.md hold (import-linter's contracts in pyproject.toml), and the check fails on
an upward import or an import cycle planted in a copy of the package."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"


def lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the package under cwd, ahead of the installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(ROOT / "trl_async", tmp_path / "trl_async", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("weights/buckets.py", "from ..rollout import pool", "layers"),  # the weights reach up into the pipeline
        ("rollout/pool.py", "from ..engines.vllm import backend", "the rollout pool knows the engines only"),
        ("engines/transformers/worker.py", "import trl", "a rollout worker process imports no TRL"),
        ("engines/transformers/decoding.py", "from . import worker", "no import cycles"),
        ("sandbox/probes.py", "from .. import trainer", "the sandbox stands alone"),
    ],
)
def test_a_planted_import_breaks_its_contract(copy, module, planted, broken):
    path = copy / "trl_async" / module
    path.write_text(path.read_text() + f"\n{planted}  # planted\n")
    done = lint(copy)
    assert done.returncode != 0 and "Broken contracts" in done.stdout, done.stdout[-3000:]
    report = done.stdout.split("Broken contracts", 1)[1]
    assert broken in " ".join(report.split()), report[:2000]
