"""The package's public names: each one imports from ``trl_async``, the errors the docs name are exported exception
classes, and importing the package alone stays light (no TRL: rollout worker processes import it)."""

import builtins
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trl_async

ROOT = Path(__file__).resolve().parents[2]
# the errors a run raises to the caller (the docs name them)
ERRORS = (
    "RewardFunctionError",
    "RolloutLaneError",
    "SandboxError",
    "SandboxUnavailable",
    "VLLMServerError",
)


def documented_error_names() -> set[str]:
    """Every `SomethingError` / `SomethingException` / `SomethingUnavailable` the user docs name that is not a
    built-in exception."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    names = set()
    for page in pages:
        names |= set(re.findall(r"`([A-Z][A-Za-z0-9]*(?:Error|Exception|Unavailable))`", page.read_text("utf-8")))
    return {name for name in names if not hasattr(builtins, name)}


@pytest.mark.parametrize("name", trl_async.__all__)
def test_every_public_name_imports_from_the_package(name):
    namespace: dict = {}
    exec(f"from trl_async import {name}", namespace)
    assert namespace[name] is getattr(trl_async, name)
    assert name in dir(trl_async)


def test_public_names_are_listed_once_and_loaded_lazily():
    assert len(set(trl_async.__all__)) == len(trl_async.__all__)
    assert set(trl_async.__all__) <= set(trl_async._LAZY) | {"__version__"}


@pytest.mark.parametrize("name", ERRORS)
def test_errors_are_exported_exception_classes(name):
    error = getattr(trl_async, name)
    assert name in trl_async.__all__
    assert isinstance(error, type) and issubclass(error, Exception)


def test_every_error_the_docs_name_is_exported():
    named = documented_error_names()
    assert {"RolloutLaneError", "RewardFunctionError", "SandboxError", "SandboxUnavailable"} <= named
    missing = sorted(named - set(trl_async.__all__))
    assert not missing, f"the docs name errors that `from trl_async import ...` does not give: {missing}"
    for name in named:
        assert issubclass(getattr(trl_async, name), Exception), name


def test_exported_errors_are_the_raised_classes():
    from trl_async.rollout.lanes import RolloutLaneError
    from trl_async.rollout.scoring import RewardFunctionError
    from trl_async.sandbox.isolation import SandboxUnavailable
    from trl_async.sandbox.zygote_client import SandboxError

    assert trl_async.RolloutLaneError is RolloutLaneError
    assert trl_async.RewardFunctionError is RewardFunctionError
    assert trl_async.SandboxError is SandboxError
    assert trl_async.SandboxUnavailable is SandboxUnavailable


def test_importing_the_package_does_not_import_trl():
    code = (
        "import sys, trl_async\n"
        "heavy = sorted(m for m in ('trl', 'peft', 'deepspeed') if m in sys.modules)\n"
        "print(heavy)\n"
        "from trl_async import SandboxError, VLLMServerError\n"
        "print('trl' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out == ["[]", "False"], out
