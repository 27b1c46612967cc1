"""A code-execution reward and a Python-interpreter tool, both plain callables that run generated code only in a
``Sandbox``: they work with ``GRPOTrainer`` as with ``AsyncGRPOTrainer``.

``CodeExecutionReward``: the completion's last fenced code block runs, then the row's tests (``assert`` statements,
each in a copy of the program's namespace); the reward is the fraction of tests that passed. No code block, code that
does not compile, code that raises before the tests run, and a run stopped by a limit all score 0, and each is
logged (``log_metric``: ``code_execution/no_code``, ``/syntax_error``, ``/crashed``, ``/stopped``) as the fraction
of the call's completions it struck, beside ``code_execution/passed_all``.

The program runs in the harness's own interpreter. The harness keeps what it relies on out of the program's reach
by ordinary means (its report carries a random token the program is not shown; its functions are locals, not module
attributes; a report that does not count the row's tests is a crash), but a program written to forge its score can
still reach the harness through the interpreter's internals (frames, the garbage collector), and a result object
whose ``__eq__`` always answers True passes an ``assert f(x) == y`` test: write tests that compare ``repr`` or
check types, as ``trl_async.demo.code_task`` does. The sandbox protects the machine from the program, not the reward
from a program that sets out to forge it.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .limits import Limits, SandboxResult
from .runner import Sandbox

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OUTCOMES = ("no_code", "syntax_error", "crashed", "stopped")  # each scores 0

# the harness keeps what it relies on in its own function's locals, so a program cannot replace them by assigning to
# a module (``builtins.exec = ...``, ``__main__.report = ...``); the token comes on stdin, which is closed before
# the program runs, and the harness's file is deleted
HARNESS = """\
def harness():
    import json, os, sys
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    os.remove("main.py")
    with open("solution.py") as f:
        source = f.read()
    with open("tests.json") as f:
        tests = json.load(f)
    os.remove("tests.json")
    run, dumps, write, flush, leave, exit_now = exec, json.dumps, os.write, sys.stdout.flush, os._exit, SystemExit

    def report(**fields):
        try:
            flush()
        except BaseException:
            pass
        write(1, ("\\n" + token + " " + dumps(fields) + "\\n").encode())
        leave(0)

    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        report(outcome="syntax_error", error=type(exc).__name__)
    namespace = {"__name__": "solution"}
    try:
        run(code, namespace)
    except BaseException as exc:
        report(outcome="crashed", error=type(exc).__name__)
    passed = 0
    for test in tests:
        try:
            run(test, dict(namespace))
            passed += 1
        except BaseException:
            pass
    report(outcome="ran", passed=passed, total=len(tests))


harness()
"""


def completion_text(completion) -> str:
    """The text of a completion: a string, or a conversation's last message's content."""
    if isinstance(completion, list):
        content = (completion[-1].get("content") if completion else None) or ""
        return content if isinstance(content, str) else " ".join(str(p.get("text") or "") for p in content)
    return completion or ""


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```), or None when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


def parse_report(result: SandboxResult, token: str, tests: int) -> dict:
    """What the harness reported (the last line with ``token``) when it is well formed and counts ``tests`` tests;
    ``{"outcome": "stopped"}`` when a limit ended the run, else ``"crashed"``."""
    if result.limits:
        return {"outcome": "stopped", "why": list(result.limits)}
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(token + " "):
            try:
                report = json.loads(line[len(token) + 1 :])
            except json.JSONDecodeError:
                break
            if well_formed(report, tests):
                return report
            break
    return {"outcome": "crashed", "error": result.summary()}


def well_formed(report, tests: int) -> bool:
    if not isinstance(report, dict) or report.get("outcome") not in ("ran", "syntax_error", "crashed"):
        return False
    if report["outcome"] != "ran":
        return True
    passed, total = report.get("passed"), report.get("total")
    return type(passed) is int and total == tests and 0 <= passed <= total


def score(report: dict) -> float:
    if report["outcome"] != "ran":
        return 0.0
    return report["passed"] / report["total"] if report["total"] else 0.0


@functools.cache
def shared_sandbox() -> Sandbox:
    """One sandbox per process, shared by the reward and the tool, so their runs together stay within the cores."""
    return Sandbox()


class CodeExecutionReward:
    """``reward_funcs=[CodeExecutionReward()]``: the fraction of the row's tests (the ``tests_column``, a list of
    ``assert`` statements) that the completion's code passes. Runs the completions of one call ``concurrency`` at
    once in ``sandbox`` (default: one shared per process)."""

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, tests_column: str = "tests"):
        self.sandbox = sandbox
        self.limits = limits or Limits(wall_s=5.0, cpu_s=5)
        self.tests_column = tests_column
        self.__name__ = "code_execution"  # GRPOTrainer names a reward function by it

    def __call__(self, completions, log_metric: Callable | None = None, **columns) -> list[float]:
        if self.tests_column not in columns:
            raise ValueError(
                f"CodeExecutionReward needs a '{self.tests_column}' column (a list of assert statements per row); the "
                f"dataset has {sorted(k for k in columns if k not in ('trainer_state', 'log_extra'))}."
            )
        reports = self.run([completion_text(c) for c in completions], columns[self.tests_column])
        scores = [score(r) for r in reports]
        if log_metric is not None:
            share = lambda hits: sum(hits) / max(1, len(reports))  # noqa: E731
            for outcome in OUTCOMES:
                log_metric(f"code_execution/{outcome}", share(r["outcome"] == outcome for r in reports))
            log_metric("code_execution/passed_all", share(s == 1.0 for s in scores))
        return scores

    def run(self, texts: Sequence[str], tests: Sequence[Sequence[str]]) -> list[dict]:
        """The harness's report for each completion text against its tests (``outcome`` and, when it ran,
        ``passed``/``total``)."""
        sandbox = self.sandbox or shared_sandbox()
        codes = [extract_code(t) for t in texts]
        jobs = [i for i, code in enumerate(codes) if code is not None]
        token = secrets.token_hex(16)

        def one(i: int) -> dict:
            files = {"solution.py": codes[i], "tests.json": json.dumps(list(tests[i]))}
            result = sandbox.run_python(HARNESS, files=files, stdin=token + "\n", limits=self.limits)
            return parse_report(result, token, len(tests[i]))

        reports: list[dict] = [{"outcome": "no_code"} for _ in codes]
        if jobs:
            with ThreadPoolExecutor(min(sandbox.concurrency, len(jobs)), thread_name_prefix="code-reward") as pool:
                for i, report in zip(jobs, pool.map(one, jobs), strict=True):
                    reports[i] = report
        return reports


def python_tool(sandbox: Sandbox | None = None, limits: Limits | None = None, max_chars: int = 2000) -> Callable:
    """A ``python`` tool for ``tools=[python_tool()]``: runs the model's code in the sandbox and returns what it
    printed (and, when it failed or was stopped, the end of its error output and why), cut to ``max_chars``."""
    limits = limits or Limits(wall_s=5.0, cpu_s=5)

    def python(code: str) -> str:
        """Run Python code in a sandbox (standard library only, no network, no files kept) and return its output.

        Args:
            code: The Python source to run. Print whatever you want to see.
        """
        result = (sandbox or shared_sandbox()).run_python(code, limits=limits)
        return tool_text(result, max_chars)

    return python


def tool_text(result: SandboxResult, max_chars: int) -> str:
    """What the model sees of a run: its stdout, then, unless it succeeded, its stderr's end and how it ended."""
    text = result.stdout
    if not result.ok:
        text += result.stderr[-max_chars // 2 :] + f"\n[{result.summary()}]"
    return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[output cut]"
