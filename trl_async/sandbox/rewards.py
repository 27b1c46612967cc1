"""A code-execution reward and a Python-interpreter tool, both plain callables that run generated code only in a
``Sandbox``: they work with ``GRPOTrainer`` as with ``AsyncGRPOTrainer``.

``CodeExecutionReward``: the completion's last fenced code block runs in the sandbox, and the row's tests (``assert``
statements) are split by ``trl_async.sandbox.probes``: the calls into the candidate's code run in the sandbox and
come back as plain data; the expected values and the comparisons stay in the trainer. The reward is the fraction of
tests passed. No code block, code that does not compile, code that raises before the tests run, and a run stopped
by a limit all score 0, and each is logged (``log_metric``: ``code_execution/no_code``, ``/syntax_error``,
``/crashed``, ``/stopped``) as the fraction of the call's completions it struck, beside ``code_execution/passed_all``.

Nothing a program does makes the reward or the tool raise: any exit, signal, output or report scores 0 (or is the
tool's message). What the program prints is only ever read as data: a line it forges can claim values, never a pass.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .limits import Limits, SandboxResult
from .probes import Raised, SplitTest, Unsplittable, passes, plain_value, split_test
from .runner import Sandbox

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OUTCOMES = ("no_code", "syntax_error", "crashed", "stopped")  # each scores 0
MARK = "@trl_async@ "  # starts each line the harness writes; the program can print such lines too: they are data

# runs in the sandbox: the solution, then each probe in a copy of its namespace, printing what each returned (its repr)
# or raised. It never sees an expected value, so nothing here needs protecting from the program.
HARNESS = """\
def harness():
    import json, os
    dumps, write, leave, text = json.dumps, os.write, os._exit, repr

    def emit(**record):
        write(1, ("\\n" + MARK + dumps(record) + "\\n").encode("utf-8", "backslashreplace"))

    with open("probes.json") as f:
        probes = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        emit(outcome="syntax_error", error=type(exc).__name__)
        leave(0)
    namespace = {"__name__": "solution"}
    try:
        exec(code, namespace)
    except BaseException as exc:
        emit(outcome="crashed", error=type(exc).__name__)
        leave(0)
    for i, (kind, probe) in enumerate(probes):
        try:
            if kind == "value":
                emit(probe=i, value=text(eval(probe, dict(namespace))))
            else:  # a whole test, run in the program's process: forgeable
                exec(probe, dict(namespace))
                emit(probe=i, passed=True)
        except BaseException as exc:
            emit(probe=i, raised=type(exc).__name__)
    emit(outcome="ran")
    leave(0)


harness()
""".replace("MARK", repr(MARK))


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


def read_harness(stdout: str, probes: int) -> tuple[str | None, dict[int, tuple]]:
    """The outcome the harness printed (None if none) and each probe's answer: ``("value", repr text)``,
    ``("raised", exception name)`` or ``("passed", True)``. Lines that are not well-formed records are skipped;
    nothing in ``stdout`` makes this raise."""
    outcome, answers = None, {}
    for line in stdout.split("\n"):
        if not line.startswith(MARK):
            continue
        try:
            record = json.loads(line[len(MARK) :])
        except Exception:  # malformed, too deep, too large: not a record
            continue
        if not isinstance(record, dict):
            continue
        if record.get("outcome") in ("ran", "syntax_error", "crashed") and outcome is None:
            outcome = record["outcome"]
        index = record.get("probe")
        if type(index) is not int or not 0 <= index < probes:
            continue
        for key, kind in (("value", str), ("raised", str), ("passed", bool)):
            if key in record and type(record[key]) is kind:
                answers[index] = (key, record[key])
    return outcome, answers


def probe_list(tests: Sequence[SplitTest]) -> list[list[str]]:
    """What the sandbox runs, in order: each test's probes, or the whole test where it could not be split."""
    return [item for t in tests for item in ([["value", p] for p in t.probes] if t.check is not None
                                             else [["exec", t.source]])]  # fmt: skip


def holds(test: SplitTest, answers: list[tuple | None]) -> bool:
    """Whether ``test`` passed, given the answers to its own probes (in order)."""
    if test.check is None:
        return answers == [("passed", True)]
    values = []
    for answer in answers:
        if answer is None or answer[0] == "passed":
            return False
        if answer[0] == "raised":
            values.append(Raised(answer[1]))
            continue
        try:
            values.append(plain_value(answer[1]))
        except ValueError:
            return False
    return passes(test, values)


def parse_report(result: SandboxResult, tests: Sequence[SplitTest]) -> dict:
    """The run's report: ``{"outcome": "ran", "passed": p, "total": n}``, or another outcome (which scores 0):
    ``"stopped"`` when a limit ended the run, the harness's ``"syntax_error"`` or ``"crashed"``, and ``"crashed"``
    when the harness never said the probes ran (the program ended them early)."""
    if result.limits:
        return {"outcome": "stopped", "why": list(result.limits)}
    counts = [len(t.probes) if t.check is not None else 1 for t in tests]
    outcome, answers = read_harness(result.stdout, sum(counts))
    if outcome != "ran":
        return {"outcome": outcome or "crashed", "error": result.summary()}
    passed, start = 0, 0
    for test, count in zip(tests, counts, strict=True):
        passed += holds(test, [answers.get(i) for i in range(start, start + count)])
        start += count
    return {"outcome": "ran", "passed": passed, "total": len(tests)}


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
    once in ``sandbox`` (default: one shared per process).

    Each test must split into calls of the candidate's code and a check evaluated in the trainer (see
    ``trl_async.sandbox.probes``); one that cannot raises ``ValueError`` naming it. ``allow_forgeable_tests=True``
    runs such tests whole in the candidate's process instead, where a program written to forge its score can pass
    them, and logs their share as ``code_execution/forgeable_tests``."""

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, tests_column: str = "tests",
                 allow_forgeable_tests: bool = False):  # fmt: skip
        self.sandbox = sandbox
        self.limits = limits or Limits(wall_s=5.0, cpu_s=5)
        self.tests_column = tests_column
        self.allow_forgeable_tests = allow_forgeable_tests
        self.__name__ = "code_execution"  # GRPOTrainer names a reward function by it

    def __call__(self, completions, log_metric: Callable | None = None, **columns) -> list[float]:
        if self.tests_column not in columns:
            raise ValueError(
                f"CodeExecutionReward needs a '{self.tests_column}' column (a list of assert statements per row); the "
                f"dataset has {sorted(k for k in columns if k not in ('trainer_state', 'log_extra'))}."
            )
        tests = [self.split(row) for row in columns[self.tests_column]]
        reports = self.run([completion_text(c) for c in completions], tests)
        scores = [score(r) for r in reports]
        if log_metric is not None:
            share = lambda hits: sum(hits) / max(1, len(reports))  # noqa: E731
            for outcome in OUTCOMES:
                log_metric(f"code_execution/{outcome}", share(r["outcome"] == outcome for r in reports))
            log_metric("code_execution/passed_all", share(s == 1.0 for s in scores))
            if self.allow_forgeable_tests:
                total = sum(len(row) for row in tests)
                log_metric(
                    "code_execution/forgeable_tests",
                    sum(t.check is None for row in tests for t in row) / max(1, total),
                )
        return scores

    def split(self, row_tests) -> list[SplitTest]:
        """One row's tests, split; a test that cannot be split raises, unless forgeable tests are allowed."""
        if isinstance(row_tests, str) or not isinstance(row_tests, Sequence):
            raise ValueError(
                f"each row's '{self.tests_column}' must be a list of assert statements, got {row_tests!r}."
            )
        split = []
        for source in row_tests:
            if not isinstance(source, str):
                raise ValueError(f"a test must be a string holding an assert statement, got {source!r}.")
            try:
                split.append(split_test(source))
            except Unsplittable as why:
                if not self.allow_forgeable_tests:
                    raise ValueError(
                        f"CodeExecutionReward cannot split the test {source!r} ({why}), so a program could forge its "
                        "result. Write it as one assert over calls of the solution's functions, with expected values "
                        "the trainer can evaluate (literals, comparisons, and built-ins such as repr, sorted, len, abs, "
                        "math.isclose), or pass allow_forgeable_tests=True to run it whole in the program's process."
                    ) from why
                split.append(SplitTest(source=source, probes=(), check=None))
        return split

    def run(self, texts: Sequence[str], tests: Sequence[Sequence[SplitTest]]) -> list[dict]:
        """The report for each completion text against its split tests (``outcome`` and, when it ran,
        ``passed``/``total``)."""
        sandbox = self.sandbox or shared_sandbox()
        codes = [extract_code(t) for t in texts]
        jobs = [i for i, code in enumerate(codes) if code is not None]

        def part(i: int, part_tests: list[SplitTest]) -> dict:
            solution = codes[i].encode("utf-8", "replace")  # lone surrogates from a decoder become U+FFFD
            files = {"solution.py": solution, "probes.json": json.dumps(probe_list(part_tests))}
            return parse_report(sandbox.run_python(HARNESS, files=files, limits=self.limits), part_tests)

        def one(i: int) -> dict:
            """Tests that cannot be split run in a run of their own: their expected values, visible to that run's
            program, must not help it with the split ones."""
            split = [t for t in tests[i] if t.check is not None]
            whole = [t for t in tests[i] if t.check is None]
            reports = [part(i, p) for p in (split, whole) if p] or [part(i, [])]
            failed = [r for r in reports if r["outcome"] != "ran"]
            return failed[0] if failed else {"outcome": "ran", "passed": sum(r["passed"] for r in reports),
                                             "total": len(tests[i])}  # fmt: skip

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
        try:
            result = (sandbox or shared_sandbox()).run_python(code, limits=limits)
        except ValueError as exc:  # the model's call, not a program: code that is not text, a lone surrogate
            return f"[the code could not be run: {exc}]"
        return tool_text(result, max_chars)

    return python


def tool_text(result: SandboxResult, max_chars: int) -> str:
    """What the model sees of a run: its stdout, then, unless it succeeded, its stderr's end and how it ended."""
    text = result.stdout
    if not result.ok:
        text += result.stderr[-max_chars // 2 :] + f"\n[{result.summary()}]"
    return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[output cut]"
