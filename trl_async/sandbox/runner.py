"""``Sandbox``: runs untrusted programs, each in a fresh sandbox, a bounded number at once, from any thread."""

from __future__ import annotations

import fcntl
import marshal
import os
import random
import selectors
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence

from .arguments import check_argv, check_files, check_limits, check_stdin
from .isolation import hidden_dirs, interpreter, is_root, resolve, seccomp_missing, visible_dirs
from .limits import Limits, SandboxResult, limits_hit
from .zygote_client import SandboxError, Zygote

PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
BACKSTOP_S = 10.0  # past the wall clock, the trainer kills a launcher that has not reported
OUTPUT_GRACE_S = 1.0  # after the launcher reported, how long output may still arrive (a child holding the pipe)
MAX_CONCURRENCY = 1024
# a root trainer runs each program as a uid of its own, from UID_BASE on, which nothing else on the machine owns: the
# process limit counts only that run, and killing the uid's processes ends all of it. A uid is taken with an
# exclusive lock on its file in UID_LOCKS, so runs of any sandbox in any process never share one. The folder is root's
# alone (mode 0700), checked on every run, and opened without following links: a folder another user planted first,
# or a link in its place, is refused rather than trusted.
UID_BASE, UID_COUNT = 0x50000000, 1 << 16
UID_LOCKS = "/run/trl_async_sandbox_uids" if os.path.isdir("/run") else "/tmp/trl_async_sandbox_uids"


def open_lock_folder(path: str) -> int:
    """A descriptor of the uid lock folder, made if missing; refused unless it is a real folder (not a link) owned by
    this user and closed to everyone else."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(f"the sandbox's uid lock folder {path} is not a folder ({exc}): it may have been planted "
                           f"by another user. Remove it (`rm -rf {path}`) and run again.") from exc  # fmt: skip
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SandboxError(
            f"the sandbox's uid lock folder {path} belongs to uid {info.st_uid} with mode {oct(info.st_mode & 0o777)}; "
            f"it must be this user's ({os.geteuid()}) with mode 0o700, or another user could plant files in it. "
            f"Remove it (`rm -rf {path}`) and run again."
        )
    return fd


class RunUid:
    """A uid no other run holds, for as long as this is open."""

    def __init__(self) -> None:
        self.uid, self._fd = None, None
        if not is_root():
            return
        folder = open_lock_folder(UID_LOCKS)
        try:
            start = random.randrange(UID_COUNT)
            for i in range(UID_COUNT):
                uid = UID_BASE + (start + i) % UID_COUNT
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    fd = os.open(str(uid), flags, 0o600, dir_fd=folder)
                except OSError as exc:
                    raise SandboxError(f"cannot open the uid lock {UID_LOCKS}/{uid}: {exc}") from exc
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return
        finally:
            os.close(folder)
        raise SandboxError(f"every sandbox uid is in use ({UID_COUNT} runs at once)")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


class Sandbox:
    """Runs programs in fresh sandboxes: ``run`` for a command, ``run_python`` for source.

    ``isolation``: ``"auto"`` (namespaces where the kernel allows them, else rlimits with a warning),
    ``"namespaces"`` (refuse to run without them) or ``"rlimits"``. ``concurrency``: runs at once (default: the
    usable cores); a call beyond it waits in its own thread, so reward and tool threads queue and the trainer's main
    thread never does.
    """

    def __init__(self, limits: Limits | None = None, isolation: str = "auto", concurrency: int | None = None) -> None:
        if concurrency is not None and not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be between 1 and {MAX_CONCURRENCY}, got {concurrency}.")
        self.limits = check_limits(limits, Limits())
        self.isolation = resolve(isolation)
        self.concurrency = concurrency or min(len(os.sched_getaffinity(0)), MAX_CONCURRENCY)
        self._free = threading.BoundedSemaphore(self.concurrency)
        self._python = interpreter(self.isolation)
        self._visible, self._hidden = visible_dirs(), hidden_dirs()
        self._zygote = Zygote(self.isolation)
        if seccomp_missing():
            warnings.warn(seccomp_missing(), RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Stop this sandbox's zygote once it has reaped the processes of every finished run (runs in flight go on to
        their end). A later run starts a new one."""
        self._zygote.close()

    def run_python(
        self, source: str, *, files: Mapping[str, str | bytes] | None = None, stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> SandboxResult:  # fmt: skip
        """Run Python ``source`` as ``main.py`` in the working directory, with the base interpreter in isolated mode
        (no site-packages: the standard library only)."""
        if not isinstance(source, str):
            raise ValueError(f"source must be Python source text (str), got {type(source).__name__}.")
        files = check_files(files)
        if "main.py" in files:
            raise ValueError("files must not hold 'main.py': run_python writes the source there.")
        argv = [self._python, "-I", "-S", "main.py"]
        return self._submit(argv, {**files, "main.py": source}, stdin, limits, python_main="main.py")

    def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> SandboxResult:
        """Run ``argv`` (a list of strings, ``argv[0]`` an absolute path inside the sandbox) in a fresh working
        directory holding ``files`` (relative name -> text or bytes), with ``stdin`` on its standard input (text as
        UTF-8, bytes as they are, None for none). Blocks the calling thread until it ends. A wrong argument raises
        ``ValueError`` naming it, before anything runs; a failure of the sandbox itself raises ``SandboxError``;
        whatever the program does comes back in the result."""
        return self._submit(argv, files, stdin, limits, python_main=None)

    def _submit(self, argv, files, stdin, limits, python_main: str | None) -> SandboxResult:
        argv = check_argv(argv)
        files = check_files(files)
        stdin = check_stdin(stdin)
        limits = check_limits(limits, self.limits)
        if argv[0] != self._zygote.python:  # only the interpreter already running can run the program in place
            python_main = None
        with self._free:
            uid = RunUid()
            try:
                return self._run(argv, files, stdin, limits, uid.uid, python_main)
            finally:
                uid.close()

    def _spec(self, argv, files, stdin, limits: Limits, uid: int | None, root: str) -> dict:
        return {
            "isolation": self.isolation,
            "root": root,
            "argv": argv,
            "files": files,
            "stdin": stdin,
            "env": {**PROGRAM_ENV, "HOME": "/sandbox" if self.isolation == "namespaces" else root, "TMPDIR": "/tmp"},
            "limits": limits.rlimits(),
            "wall_s": limits.wall_s,
            "cpu_s": limits.cpu_s,
            "disk_bytes": int(limits.disk_mib * (1 << 20)),
            "binds": self._visible,
            "hide": self._hidden,
            "drop_uid": uid is not None,
            "own_user_namespace": not is_root(),
            "uid": 0 if uid is None else uid,
        }

    def _run(self, argv, files, stdin, limits: Limits, uid: int | None, python_main: str | None) -> SandboxResult:
        owned: list[int] = []  # every descriptor made here, closed once whatever happens
        root = tempfile.mkdtemp(prefix="trl_async_sandbox_")
        started = time.monotonic()
        try:
            (out_r, out_w), (err_r, err_w), (status_r, status_w) = _pipe(owned), _pipe(owned), _pipe(owned)
            alive_r, alive_w = _pipe(owned)  # the launcher stops the run when this closes: the trainer is gone
            spec = marshal.dumps({**self._spec(argv, files, stdin, limits, uid, root), "python_main": python_main})
            self._zygote.start_run(spec, out_w, err_w, status_w, alive_r)
            for fd in (out_w, err_w, status_w, alive_r):  # the run holds them now
                owned.remove(fd)
                os.close(fd)
            deadline = started + limits.wall_s + BACKSTOP_S
            streams = _read(out_r, err_r, status_r, alive_w, limits.output_bytes, deadline)
        finally:
            for fd in owned:
                os.close(fd)
            shutil.rmtree(root, ignore_errors=True)
        stdout, stderr, status, exceeded, backstop = streams
        report = _report(status, backstop, lost_is_the_programs=self.isolation == "rlimits" and not is_root())
        if report.get("lost"):
            stderr += "\n[sandbox: the run's launcher ended without a report]"
        cpu_s = report.get("cpu_s", 0.0)
        hit = limits_hit(
            timed_out=report["timed_out"],
            output_exceeded=exceeded,
            signal_number=report["signal"],
            stderr=stderr,
            cpu_s=max(cpu_s, limits.cpu_s) if report.get("cpu_stopped") else cpu_s,
            cpu_limit_s=limits.cpu_s,
            disk_full=report.get("disk_full", False),
        )
        return SandboxResult(
            exit_code=None if exceeded else report["exit"],
            signal=None if exceeded else report["signal"],
            stdout=stdout,
            stderr=stderr,
            limits=hit,
            seconds=report.get("seconds", time.monotonic() - started),
            isolation=self.isolation,
        )


def _pipe(owned: list[int]) -> tuple[int, int]:
    r, w = os.pipe()
    owned += [r, w]
    return r, w


def _report(status: bytes, backstop: bool, lost_is_the_programs: bool) -> dict:
    """The launcher's report. None at all: past the backstop, a run that timed out; otherwise a launcher killed
    mid-run, which only the program can have done where it runs as the trainer's user (``lost_is_the_programs``: a
    failed run) and is the sandbox's failure anywhere else."""
    try:
        report = marshal.loads(status) if status else None
    except (EOFError, ValueError, TypeError):
        report = None
    if not isinstance(report, dict):
        if backstop:
            return {"timed_out": True, "exit": None, "signal": None}
        if lost_is_the_programs:
            return {"timed_out": False, "exit": None, "signal": None, "lost": True}
        raise SandboxError("the sandbox's launcher ended without a report")
    if "setup_error" in report:
        raise SandboxError(f"the sandbox could not be set up: {report['setup_error']}")
    return report


def _read(out_fd: int, err_fd: int, status_fd: int, alive_fd: int, cap: int, deadline: float):
    """Read stdout, stderr and the status pipe to their ends, keeping ``cap`` bytes of each stream. More than that on
    either closes both and ``alive_fd``, which ends the run (its launcher kills it and reports); the deadline, a
    backstop past the wall clock, stops the reading."""
    kept = {out_fd: bytearray(), err_fd: bytearray(), status_fd: bytearray()}
    exceeded = backstop = stopped = False
    reported = deadline
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if status_fd not in sel.get_map():  # reported: only a child left behind can still hold the pipes open
                deadline = min(deadline, reported + OUTPUT_GRACE_S)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
            elif left <= 0:
                backstop = True
                break
            for key, _ in sel.select(left):
                if key.fd not in sel.get_map():
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    if key.fd == status_fd:
                        reported = time.monotonic()
                    continue
                buf = kept[key.fd]
                buf += chunk
                if key.fd != status_fd and len(buf) > cap:
                    del buf[cap:]
                    exceeded = True
            if exceeded and not stopped:  # once: the launcher ends the run when alive_fd closes
                stopped = True
                for fd in (out_fd, err_fd):  # the numbers stay the caller's, to close once
                    if fd in sel.get_map():
                        sel.unregister(fd)
                        _detach(fd)
                _detach(alive_fd)
    text = lambda buf: buf.decode(errors="replace")  # noqa: E731
    return text(kept[out_fd]), text(kept[err_fd]), bytes(kept[status_fd]), exceeded, backstop


def _detach(fd: int) -> None:
    """Close the pipe behind ``fd`` but keep the number (now /dev/null): no other thread can be given it meanwhile."""
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
