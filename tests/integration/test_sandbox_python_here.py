"""``run_python`` runs the program in a fork of the sandbox's already-running interpreter: it must end, print and
see the same as ``python -I -S main.py`` started fresh in the same sandbox."""

import pytest

from trl_async.sandbox import Limits, Sandbox

PROGRAMS = {
    "prints": "print('hi', 'é')",
    "exits_with_a_code": "raise SystemExit(3)",
    "exits_with_a_message": "raise SystemExit('bye')",
    "exits_with_a_large_code": "import sys\nsys.exit(300)",
    "raises": "def f():\n    return 1 / 0\nf()",
    "does_not_compile": "def f(:\n    pass",
    "runs_atexit_and_joins_threads": (
        "import atexit, threading, time\natexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.1), print('thread done'))).start()\nprint('main done')"
    ),
    "reads_stdin": "import sys\nprint(input(), sys.stdin.read())",
    "sees_its_world": (
        "import os, signal, sys\nprint(sys.argv, __name__, __file__, os.getcwd(), dict(os.environ))\n"
        "print(signal.getsignal(signal.SIGINT).__name__, signal.getsignal(signal.SIGPIPE), "
        "signal.getsignal(signal.SIGTERM))\nprint(sorted(os.listdir('/proc/self/fd'))[:3], sys.flags.isolated, "
        "sys.flags.no_site)\nprint([m for m in ('launcher', 'zygote', 'syscall_filter', 'python_here') if m in sys.modules])\n"
        "print([(s.encoding, s.errors, s.line_buffering, s.seekable()) for s in (sys.stdin, sys.stdout, sys.stderr)])\n"
        "print(sys.flags.utf8_mode, sys.orig_argv[1:], __loader__.__class__.__name__, sys.getrecursionlimit() > 900)"
    ),
    "exits_by_os_exit": "import os\nprint('buffered', end='')\nos._exit(4)",
    "dies_by_a_signal": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    "is_interrupted": "raise KeyboardInterrupt",
    "exits_with_a_huge_code": "raise SystemExit(2 ** 70)",
    "leaves_a_file_unflushed": "f = open('out.txt', 'w')\nf.write('kept')\nimport atexit\natexit.register(lambda: None)",
    "replaces_stdout": "import io, sys\nsys.stdout = io.StringIO()\nsys.__stdout__.write('through the original')",
    "recurses_deeply": "import sys\ndef f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f(sys.getrecursionlimit() - 10))",
    "holds_no_capability": (
        "import socket\nfields = dict(l.split(':') for l in open('/proc/self/status') if l.startswith('Cap'))\n"
        "print({k: int(v, 16) for k, v in fields.items()})\n"
        "try:\n    socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)\n    print('RAW SOCKET')\n"
        "except OSError as exc:\n    print('refused raw socket', exc.errno)"
    ),
}


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(limits=Limits(wall_s=10, cpu_s=5), isolation="namespaces")


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_program_run_in_place_behaves_as_a_fresh_interpreter(name, sandbox):
    source = PROGRAMS[name]
    in_place = sandbox.run_python(source, stdin="line1\nrest")
    fresh = sandbox.run([sandbox._python, "-I", "-S", "main.py"], files={"main.py": source}, stdin="line1\nrest")
    assert (in_place.stdout, in_place.exit_code, in_place.signal) == (fresh.stdout, fresh.exit_code, fresh.signal)
    assert in_place.stderr == fresh.stderr  # tracebacks included: the same frames, nothing of the sandbox's
    if name == "holds_no_capability":
        assert "'CapEff': 0" in in_place.stdout and "'CapPrm': 0" in in_place.stdout and "RAW" not in in_place.stdout


def test_runs_in_place_share_no_state(sandbox):
    """Each run is a fresh fork of a zygote that never holds a run's data: random state, modules and files differ."""
    source = "import random, sys\nprint(random.random(), 'mine' in sys.modules)\nsys.modules['mine'] = sys\n"
    first, second = sandbox.run_python(source), sandbox.run_python(source)
    assert first.stdout.split()[1] == second.stdout.split()[1] == "False" and first.stdout != second.stdout
