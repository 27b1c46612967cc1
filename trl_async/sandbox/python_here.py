"""Run a Python program in the interpreter that is already running, as ``python -I -S main.py`` would, without
starting a new one: for ``Sandbox.run_python``, in the program's process once its limits, privileges (every
capability dropped) and seccomp filter are in place.

That interpreter is a fork of the zygote (itself ``python -I -S``, which never holds another run's data): the
program gets a fresh ``__main__``, its own environment, ``sys.argv``, Python's default signal handlers, standard
streams over its own pipes, and none of the sandbox's own modules. What it shares with every other run is what the
zygote's start fixed: the string hash seed, the address-space layout, and the standard-library modules already
imported (``ctypes``, ``socket``, ``select``). It ends the way the ``python`` command does: a traceback (without this
module's frames) and status 1 for an exception, death by SIGINT for ``KeyboardInterrupt``, ``SystemExit``'s code,
non-daemon threads joined, ``atexit`` handlers run, ``__main__``'s objects released, the standard streams flushed
(status 120 when that fails). Imported by the launcher only (the standard library alone).
"""

import _signal as signal
import builtins
import gc
import io
import os
import sys
import types

SANDBOX_MODULES = ("launcher", "libc", "python_here", "root", "syscall_filter", "zygote")
LONG_MAX = (1 << 63) - 1


def exit_status(code) -> int:
    """The status ``raise SystemExit(code)`` ends ``python`` with (a message, then 1, for anything but an int)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -LONG_MAX - 1 <= code <= LONG_MAX else 255
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:  # noqa: BLE001 - as CPython, a failing message still exits 1
        pass
    return 1


def fresh_stdio() -> None:
    """Standard streams over descriptors 0-2 as the ``python`` command makes them, with the zygote's encodings (its
    locale is the programs'): the zygote's own were made over /dev/null, which seeks where a pipe does not."""
    made = []
    for fd, old, kind in ((0, sys.stdin, io.BufferedReader), (1, sys.stdout, io.BufferedWriter),
                          (2, sys.stderr, io.BufferedWriter)):  # fmt: skip
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        made.append(io.TextIOWrapper(kind(raw), encoding=old.encoding, errors=old.errors, line_buffering=fd == 2))
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def finish(status: int, main: types.ModuleType) -> None:
    """What the interpreter does at exit: join non-daemon threads, run ``atexit``, release ``__main__``'s objects
    (open files flush), flush the standard streams, then leave."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:  # noqa: BLE001
            pass
    import atexit

    atexit._run_exitfuncs()
    try:
        main.__dict__.clear()
        gc.collect()
    except BaseException:  # noqa: BLE001 - a __del__ that raises, as at interpreter exit, is ignored
        pass
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            status = 120
    os._exit(status)


def show(exc_type, exc, tb) -> None:
    """The program's traceback, starting at its own frames."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    sys.excepthook(exc_type, exc.with_traceback(tb), tb)  # the display reads the exception's own traceback


def run(path: str, env: dict, argv: list, sandbox_dir: str) -> None:
    """Run the program in ``path`` (in the working directory) here; never returns."""
    for name in (*SANDBOX_MODULES, "__main__"):
        sys.modules.pop(name, None)
    sys.path[:] = [p for p in sys.path if p != sandbox_dir]
    sys.orig_argv = list(argv)
    os.environ.clear()
    os.environ.update(env)
    fresh_stdio()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as the python command sets them
        signal.signal(number, signal.SIG_IGN)
    from importlib.machinery import SourceFileLoader

    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = os.path.abspath(path), builtins  # python makes a script's path absolute
    main.__loader__, main.__cached__ = SourceFileLoader("__main__", main.__file__), None
    sys.modules["__main__"] = main
    sys.argv = [path]
    status = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit as exc:
        status = exit_status(exc.code)
    except KeyboardInterrupt:
        show(*sys.exc_info())
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # python ends by the signal, as the shell expects
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the program's own failure, reported as python reports it
        show(*sys.exc_info())
        status = 1
    finish(status, main)
