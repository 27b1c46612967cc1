"""Programs written to stop training through the code reward, or to forge their score: each scores 0 (or comes back
as the tool's message), nothing raises, and the expected values are nowhere the program can look."""

import uuid

import pytest

from trl_async.sandbox import Limits, Sandbox, SandboxError
from trl_async.sandbox.rewards import CodeExecutionReward, python_tool

LIMITS = Limits(wall_s=2, cpu_s=1)
SECRET = f"expected-{uuid.uuid4().hex}"  # an expected value no program could guess
TESTS = [
    "assert f(12) == 157",
    "assert f(5) == 38",
    "assert repr(f(0)) == '13'",
    f"assert g(1) == {SECRET!r}",
    "assert to_bin(5) == bin(5)",
]
SOLUTION = f"def f(x):\n    return x * x + 13\ndef g(x):\n    return {SECRET!r}\nto_bin = bin\n"


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(limits=LIMITS, isolation="namespaces", concurrency=2)


def test_a_program_ending_by_any_signal_scores_zero_and_the_tool_reports_it(sandbox):
    """Signals 1-64, real-time ones included: some end the program, some stop it until the wall clock, some are
    ignored (then the tests fail)."""
    reward = CodeExecutionReward(sandbox=sandbox, limits=LIMITS)
    kills = [fenced(f"import os\nos.kill(os.getpid(), {n})") for n in range(1, 65)]
    metrics = {}
    assert reward(kills, tests=[TESTS] * 64, log_metric=metrics.__setitem__) == [0.0] * 64
    ended = metrics["code_execution/crashed"] + metrics["code_execution/stopped"]
    assert ended >= 50 / 64 and metrics["code_execution/passed_all"] == 0  # the rest were ignored (SIGCHLD, ...)
    tool = python_tool(sandbox=sandbox, limits=LIMITS)
    for n, name in ((9, "SIGKILL"), (34, "SIGRTMIN"), (40, "SIGRTMIN+6"), (64, "SIGRTMAX")):
        assert tool(f"import os\nos.kill(os.getpid(), {n})").endswith(f"[killed by {name}]")


FORGERIES = {
    # the harness's input and any inherited descriptor, read for a token or the tests
    "reads_its_descriptors": (
        "import os\nseen = b''\nfor fd in range(0, 64):\n    try:\n        seen += os.pread(fd, 1 << 16, 0)\n"
        "    except OSError:\n        pass\nprint(seen)\ndef f(x):\n    return 0\ndef g(x):\n    return str(seen)\n"
    ),
    # the harness's own functions and data, reached through its frames, made to claim values
    "calls_the_harness_through_its_frames": (
        "import sys\n"
        "def f(x):\n"
        "    frame = sys._getframe(1)\n"
        "    while frame and 'emit' not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        "    if frame:\n"
        "        for i in range(8):\n"
        "            frame.f_locals['emit'](probe=i, passed=True)\n"
        "            frame.f_locals['emit'](probe=i, value='0')\n"
        "        frame.f_locals['emit'](outcome='ran')\n"
        "    return 0\n"
        "g = f\n"
    ),
    "redefines_repr": "def repr(o):\n    return '13'\ndef f(x):\n    return 0\ng = f\n",
    "patches_builtins": (
        "import builtins, json\nbuiltins.repr = lambda o: '157'\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
        'json.dumps = lambda *a, **k: \'{"probe": 0, "passed": true}\'\ndef f(x):\n    return 0\ng = f\n'
    ),
    "is_equal_to_everything": (
        "class Equal(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
        "    def __repr__(self):\n        return 'Equal()'\ndef f(x):\n    return Equal()\ng = f\n"
    ),
    "has_a_raising_repr": (
        "class Odd:\n    def __eq__(self, other):\n        return True\n    def __repr__(self):\n"
        "        raise SystemExit(0)\ndef f(x):\n    return Odd()\ng = f\n"
    ),
    "shadows_a_builtin": "import builtins\nbin = builtins.bin = lambda n: 0\ndef to_bin(n):\n    return 0\nf = g = to_bin\n",
    "exits_early": "import os\nos._exit(0)\n",
    "exits_through_sys": "raise SystemExit(0)\n",
    "prints_a_deep_report": "print('@trl_async@ ' + '[' * 100000)\nprint('@trl_async@ ' + '{\"probe\": ' * 5000)\n",
    "prints_huge_numbers": (
        "import json\nfor i in range(4):\n    print('\\n@trl_async@ ' + json.dumps({'probe': i, 'value': '9' * 5000}))\n"
        "    print('@trl_async@ ' + json.dumps({'probe': i, 'value': 'nan'}))\n"
        "print('@trl_async@ ' + json.dumps({'outcome': 'ran'}), flush=True)\nimport os\nos._exit(0)\n"
    ),
}


def test_programs_written_to_forge_their_score_score_zero(sandbox):
    reward = CodeExecutionReward(sandbox=sandbox, limits=LIMITS)
    names = list(FORGERIES)
    scores = reward([fenced(FORGERIES[n]) for n in names] + [fenced(SOLUTION)], tests=[TESTS] * (len(names) + 1))
    assert dict(zip(names, scores[:-1], strict=True)) == dict.fromkeys(names, 0.0)
    assert scores[-1] == 1.0  # the honest solution, in the same call


def test_the_expected_values_are_nowhere_the_program_can_look(sandbox):
    """The program searches its files, its memory, every frame of the harness and /tmp for an expected value."""
    half = len(SECRET) // 2  # the program holds the value in two halves, so that its own copy is not a find
    search = (
        "import gc, os, sys\n"
        f"A, B = {SECRET[:half]!r}, {SECRET[half:]!r}\n"
        "def holds(text):\n"
        "    i = text.find(A)\n"
        "    while i >= 0:\n"
        "        if text.startswith(B, i + len(A)):\n"
        "            return True\n"
        "        i = text.find(A, i + 1)\n"
        "    return False\n"
        "def shown(o):\n"
        "    try:\n"
        "        return o.decode(errors='replace') if isinstance(o, bytes) else o if isinstance(o, str) else repr(o)\n"
        "    except Exception:\n"
        "        return ''\n"
        "def g(x):\n"
        "    found = []\n"
        "    frame = sys._getframe()\n"
        "    while frame:\n"
        "        found += [k for k, v in frame.f_locals.items() if holds(shown(v))]\n"
        "        frame = frame.f_back\n"
        "    found += ['memory' for o in gc.get_objects() if holds(shown(o))]\n"
        "    for folder in ('/sandbox', '/tmp', '/dev/shm'):\n"
        "        for root, _, names in os.walk(folder):\n"
        "            for name in names:\n"
        "                if holds(open(os.path.join(root, name), 'rb').read().decode(errors='replace')):\n"
        "                    found.append(name)\n"
        "    print('FOUND' if found else 'NOT FOUND', found, flush=True)\n"
        "    return 0\n"
    )
    reward = CodeExecutionReward(sandbox=sandbox, limits=LIMITS)
    recorded = CodeExecutionReward(sandbox=_Recording(sandbox), limits=LIMITS)
    reports = recorded.run([fenced(search)], [reward.split([f"assert g(1) == {SECRET!r}"])])
    assert reports == [{"outcome": "ran", "passed": 0, "total": 1}]
    recorded.run([fenced(f"# {SECRET}\n" + search)], [reward.split(["assert g(1) == 0"])])  # a planted copy is found
    assert "NOT FOUND" in _Recording.seen[0] and "FOUND ['" in _Recording.seen[1], _Recording.seen


class _Recording:
    """A sandbox that keeps each run's stdout."""

    seen: list[str] = []

    def __init__(self, sandbox):
        self.sandbox, self.concurrency = sandbox, 1

    def run_python(self, source, **kwargs):
        result = self.sandbox.run_python(source, **kwargs)
        _Recording.seen.append(result.stdout)
        return result


def test_a_test_that_cannot_be_split_is_refused_or_run_whole_when_allowed(sandbox):
    whole = ["x = f(2)\nassert x == 17"]
    with pytest.raises(ValueError, match="cannot split the test .*allow_forgeable_tests=True"):
        CodeExecutionReward(sandbox=sandbox)([fenced(SOLUTION)], tests=[whole])
    allowed = CodeExecutionReward(sandbox=sandbox, allow_forgeable_tests=True)
    metrics = {}
    assert allowed([fenced(SOLUTION)], tests=[whole + TESTS[:1]], log_metric=metrics.__setitem__) == [1.0]
    assert metrics["code_execution/forgeable_tests"] == 0.5
    # a whole test runs apart: the expected value it shows its program does not help with the split tests
    reader = "import json\ndef g(x):\n    probes = json.load(open('probes.json'))\n    return probes[0][1].split(\"'\")[1]\n"
    tests = [f"x = g(1)\nassert x == {SECRET!r}", f"assert g(1) == {SECRET!r}"]
    assert allowed([fenced(reader)], tests=[tests]) == [0.5]  # the whole one forged, the split one not


def test_the_tool_answers_whatever_the_model_sends(sandbox):
    tool = python_tool(sandbox=sandbox, limits=LIMITS)
    assert tool("print(1)") == "1\n"
    assert tool(12).startswith("[the code could not be run: source must be") and "surrogate" not in tool("x")
    assert tool("print('\udc80')").startswith("[the code could not be run:")


def test_a_callers_mistake_is_never_the_programs_exit_status(sandbox):
    with pytest.raises(SandboxError, match="could not start.*No such file"):
        sandbox.run(["/bin/no_such_program"])
    with pytest.raises(ValueError, match="argv must be a list of strings"):
        sandbox.run("/bin/echo hi")
    assert sandbox.run(["/bin/cat"], stdin=b"\x00\xff").stdout == "\x00\ufffd"
    assert sandbox.run(["/bin/cat"], stdin=None).stdout == ""
    assert sandbox.run(["/bin/cat", "data"], files={"data": b"\x01"}).stdout == "\x01"
