"""Below the trainer, nothing reads the trainer's attributes: the pool and the checks are built from what
trl_async/setup/trainer_view.py hands them, including the view of the trainer a user's rollout_func receives. The
demo (demo/) is a user of the trainer, above it; so is agents/, a rollout_func, which reads only the view every
rollout_func receives."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trl_async"
TRAINER_SIDE = {"trainer.py", "setup/trainer_view.py", "correction/seam.py"}  # the trainer and its own mixin
EXCEPTIONS: set[str] = set()

pytestmark = pytest.mark.unit


def names_a_trainer(node: ast.AST) -> bool:
    """``trainer``, ``self._trainer``, ``p.rollout_func_trainer``: a name or attribute ending in "trainer"."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("trainer")


def trainer_reads(source: str) -> list[str]:
    """Attributes read off a trainer (``trainer.args``, ``self.trainer.state``, ``getattr(trainer, "x")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and names_a_trainer(node.value):
            found.append(f"{ast.unparse(node.value)}.{node.attr} (line {node.lineno})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args and names_a_trainer(node.args[0])):  # fmt: skip
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_the_check_finds_a_planted_read():
    assert trainer_reads("def f(trainer):\n    return trainer._geometry\n") == ["trainer._geometry (line 2)"]
    assert trainer_reads("class A:\n    def f(self):\n        return self.trainer.state\n") == [
        "self.trainer.state (line 3)"
    ]
    assert trainer_reads("x = getattr(trainer, '_geometry')\n") == ["getattr(trainer, '_geometry') (line 1)"]
    assert trainer_reads("x = self._trainer.state\n") == ["self._trainer.state (line 1)"]
    assert trainer_reads("x = p.rollout_func_trainer._geometry\n") == ["p.rollout_func_trainer._geometry (line 1)"]
    assert trainer_reads("def f(p):\n    return p.trainer_state()\n") == []


def test_no_module_below_the_trainer_reads_a_trainer_attribute():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in TRAINER_SIDE or name in EXCEPTIONS or name.startswith(("demo/", "agents/")):
            continue
        reads = trainer_reads(path.read_text())
        if reads:
            offenders[name] = reads
    assert offenders == {}
