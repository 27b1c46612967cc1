"""Run a Python program in the interpreter that is already running, as ``python -I -S main.py`` would, without
starting a new one: for ``Sandbox.run_python``, in the program's process once its limits, privileges and seccomp
filter are in place.

That interpreter is a fork of the zygote (itself ``python -I -S``, which never holds another run's data): the
program gets a fresh ``__main__``, its own environment, ``sys.argv``, Python's default signal handlers, and none of the
sandbox's own modules. What it shares with every other run is what the zygote's start fixed: the string hash seed
and the standard-library modules already imported (``ctypes``, ``socket``, ``select``). It ends the way the ``python`` command does: a traceback and status 1 for an exception,
``SystemExit``'s code, non-daemon threads joined, ``atexit`` handlers run, the standard streams flushed (status 120
when that fails). Imported by the launcher only (the standard library alone).
"""

import _signal as signal
import builtins
import os
import sys
import types

SANDBOX_MODULES = ("launcher", "syscall_filter", "python_here", "zygote")


def exit_status(code) -> int:
    """The status ``raise SystemExit(code)`` ends ``python`` with (a message for anything but an int or None)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:  # noqa: BLE001 - as CPython, a failing message still exits 1
        pass
    return 1


def finish(status: int) -> None:
    """What the interpreter does at exit: join non-daemon threads, run ``atexit``, flush, then leave."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:  # noqa: BLE001
            pass
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            status = 120
    os._exit(status)


def run(path: str, env: dict, sandbox_dir: str) -> None:
    """Run the program in ``path`` (in the working directory) here; never returns."""
    for name in (*SANDBOX_MODULES, "__main__"):
        sys.modules.pop(name, None)
    sys.path[:] = [p for p in sys.path if p != sandbox_dir]
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as the python command sets them
        signal.signal(number, signal.SIG_IGN)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = os.path.abspath(path), builtins  # as python makes a script's path absolute
    sys.modules["__main__"] = main
    sys.argv = [path]
    status = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit as exc:
        status = exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - the program's own failure, reported as python reports it
        sys.excepthook(*sys.exc_info())
        status = 1
    finish(status)
