"""The checks ``Sandbox.run`` makes of its arguments before anything runs: each wrong argument raises ``ValueError``
naming it and the fix, so that a caller's mistake never comes back as the program's exit status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .isolation import is_root
from .limits import Limits


def check_files(files) -> dict[str, bytes]:
    """``files`` as relative name -> bytes; a name that leaves the working directory, or content that is neither
    text nor bytes, raises ``ValueError`` naming it."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise ValueError(
            f"files must be a mapping of relative file name to text or bytes, got {type(files).__name__}."
        )
    checked = {}
    for name, content in files.items():
        if not isinstance(name, str):
            raise ValueError(f"a sandbox file name must be a string, got {name!r}.")
        parts = name.split("/")
        if not name or name.startswith("/") or {"..", ".", ""} & set(parts) or "\x00" in name:
            raise ValueError(f"a sandbox file name must be a relative path inside the working directory, got {name!r}")
        if any(len(p.encode(errors="replace")) > 255 for p in parts):
            raise ValueError(f"a sandbox file name's parts must be at most 255 bytes each, got {name[:80]!r}...")
        checked[name] = as_bytes(content, f"files[{name!r}]")
    return checked


def as_bytes(value, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} is text that UTF-8 cannot encode ({exc.reason}); pass bytes instead.") from exc
    raise ValueError(f"{what} must be str or bytes, got {type(value).__name__}.")


def check_argv(argv) -> list[str]:
    if isinstance(argv, (str, bytes)):
        raise ValueError(f"argv must be a list of strings, not one string: pass {str(argv).split()!r}, not {argv!r}.")
    if not isinstance(argv, Sequence) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}.")
    for arg in argv:
        if not isinstance(arg, str) or "\x00" in arg:
            raise ValueError(f"every argv item must be a string without NUL characters, got {arg!r}.")
    if not argv[0].startswith("/"):
        raise ValueError(
            f"argv[0] must be an absolute path inside the sandbox (such as /usr/bin/python3), got {argv[0]!r}."
        )
    return list(argv)


def check_stdin(stdin) -> bytes:
    """``stdin``: text (sent as UTF-8), bytes (sent as they are), or None (no input: the program reads end-of-file)."""
    return b"" if stdin is None else as_bytes(stdin, "stdin")


def check_limits(limits, default: Limits) -> Limits:
    if limits is None:
        return default
    if not isinstance(limits, Limits):
        raise ValueError(f"limits must be a trl_async.sandbox.Limits, got {type(limits).__name__}: pass "
                         "Limits(**your_settings).")  # fmt: skip
    problem = machine_problem(limits)
    if problem:
        raise ValueError(problem)
    return limits


def machine_problem(limits: Limits) -> str | None:
    """A limit this machine will not let the launcher set, with the fix (None when all can be set). A non-root trainer
    cannot raise a hard limit it inherited; no process may open more files than ``fs.nr_open``."""
    import resource

    ceilings = {"cpu_s": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_AS, "processes": resource.RLIMIT_NPROC,
                "file_bytes": resource.RLIMIT_FSIZE, "open_files": resource.RLIMIT_NOFILE}  # fmt: skip
    names = {"cpu_s": "cpu_s", "memory_bytes": "memory_mib", "processes": "processes", "file_bytes": "file_mib",
             "open_files": "open_files"}  # fmt: skip
    for key, value in limits.rlimits().items():
        hard = resource.getrlimit(ceilings[key])[1]
        if key == "open_files":
            try:
                with open("/proc/sys/fs/nr_open") as f:
                    nr_open = int(f.read())
            except (OSError, ValueError):
                nr_open = hard
            hard = nr_open if is_root() else min(hard, nr_open) if hard != resource.RLIM_INFINITY else nr_open
        elif is_root():
            continue
        if key == "cpu_s":
            value += 1  # the hard limit, a second past the soft one
        if hard != resource.RLIM_INFINITY and value > hard:
            return (f"Limits.{names[key]} asks for {value} where this machine allows this user at most {hard} "
                    f"(its hard limit): lower Limits.{names[key]}.")  # fmt: skip
    return None
