"""``Sandbox``: runs untrusted programs, each in a fresh sandbox, a bounded number at once, from any thread."""

from __future__ import annotations

import fcntl
import marshal
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from .isolation import LAUNCHER, hidden_dirs, interpreter, is_root, resolve, unshare_args, visible_dirs
from .limits import Limits, SandboxResult, limits_hit

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


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the message says where."""


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


def _check_files(files) -> dict[str, bytes]:
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
        if not name or name.startswith("/") or ".." in parts or "" in parts or "\x00" in name:
            raise ValueError(f"a sandbox file name must be a relative path inside the working directory, got {name!r}")
        checked[name] = _as_bytes(content, f"files[{name!r}]")
    return checked


def _as_bytes(value, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} is text that UTF-8 cannot encode ({exc.reason}); pass bytes instead.") from exc
    raise ValueError(f"{what} must be str or bytes, got {type(value).__name__}.")


def _check_argv(argv) -> list[str]:
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


def _check_stdin(stdin) -> bytes:
    """``stdin``: text (sent as UTF-8), bytes (sent as they are), or None (no input: the program reads end-of-file)."""
    return b"" if stdin is None else _as_bytes(stdin, "stdin")


def _check_limits(limits, default: Limits) -> Limits:
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
        if hard != resource.RLIM_INFINITY and value > hard:
            return (f"Limits.{names[key]} asks for {value} where this machine allows this user at most {hard} "
                    f"(its hard limit): lower Limits.{names[key]}.")  # fmt: skip
    return None


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
        self.limits = _check_limits(limits, Limits())
        self.isolation = resolve(isolation)
        self.concurrency = concurrency or min(len(os.sched_getaffinity(0)), MAX_CONCURRENCY)
        self._free = threading.BoundedSemaphore(self.concurrency)
        self._python = interpreter(self.isolation)
        self._visible, self._hidden = visible_dirs(), hidden_dirs()

    def run_python(
        self, source: str, *, files: Mapping[str, str | bytes] | None = None, stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> SandboxResult:  # fmt: skip
        """Run Python ``source`` as ``main.py`` in the working directory, with the base interpreter in isolated mode
        (no site-packages: the standard library only)."""
        if not isinstance(source, str):
            raise ValueError(f"source must be Python source text (str), got {type(source).__name__}.")
        if files is not None and isinstance(files, Mapping) and "main.py" in files:
            raise ValueError("files must not hold 'main.py': run_python writes the source there.")
        return self.run(
            [self._python, "-I", "-S", "main.py"],
            files={**(files or {}), "main.py": source},
            stdin=stdin,
            limits=limits,
        )

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
        argv = _check_argv(argv)
        files = _check_files(files)
        stdin = _check_stdin(stdin)
        limits = _check_limits(limits, self.limits)
        with self._free:
            uid = RunUid()
            try:
                return self._run(argv, files, stdin, limits, uid.uid)
            finally:
                uid.close()

    def _spec(self, argv, files, stdin, limits: Limits, uid: int | None, root: str, fds: tuple[int, int]) -> dict:
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
            "status_fd": fds[0],
            "alive_fd": fds[1],
            "drop_uid": uid is not None,
            "uid": 0 if uid is None else uid,
        }

    def _run(self, argv, files, stdin, limits: Limits, uid: int | None) -> SandboxResult:
        root = tempfile.mkdtemp(prefix="trl_async_sandbox_")
        status_r, status_w = os.pipe()
        alive_r, alive_w = os.pipe()  # the launcher stops the run when this closes: the trainer is gone
        launch = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "-I", "-S", LAUNCHER]
        command = [*unshare_args(), "--", *launch] if self.isolation == "namespaces" else launch
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, alive_r),
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (status_r, status_w, alive_r, alive_w):
                os.close(fd)
            shutil.rmtree(root, ignore_errors=True)
            raise SandboxError(f"could not start the sandbox launcher: {exc}") from exc
        os.close(status_w)
        os.close(alive_r)
        try:
            try:
                proc.stdin.write(marshal.dumps(self._spec(argv, files, stdin, limits, uid, root, (status_w, alive_r))))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the launcher died at once: its missing report says so below
            streams = _read(proc, status_r, limits.output_bytes, started + limits.wall_s + BACKSTOP_S)
        finally:
            _kill(proc)
            os.close(status_r)
            os.close(alive_w)
            shutil.rmtree(root, ignore_errors=True)
        stdout, stderr, status, exceeded, backstop = streams
        report = _report(status, backstop, proc.returncode, stderr)
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


def _report(status: bytes, backstop: bool, returncode: int | None, stderr: str) -> dict:
    if backstop:
        return {"timed_out": True, "exit": None, "signal": None}
    try:
        report = marshal.loads(status) if status else None
    except (EOFError, ValueError, TypeError):
        report = None
    if report is None:
        raise SandboxError(f"the sandbox launcher ended (status {returncode}) without a report: {stderr[-2000:]}")
    if "setup_error" in report:
        raise SandboxError(f"the sandbox could not be set up: {report['setup_error']}")
    return report


def _read(proc: subprocess.Popen, status_fd: int, cap: int, deadline: float):
    """Read stdout, stderr and the status pipe to their ends, keeping ``cap`` bytes of each stream. More than that on
    either closes both (the program's next write ends it with SIGPIPE, or the wall clock does); the deadline, a
    backstop past the wall clock, stops the reading."""
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    exceeded = backstop = False
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
                    for stream in (proc.stdout, proc.stderr):
                        if stream.fileno() in sel.get_map():
                            sel.unregister(stream.fileno())
            if exceeded:
                proc.stdout.close()
                proc.stderr.close()
    text = lambda buf: buf.decode(errors="replace")  # noqa: E731
    out, err = list(kept.values())[:2]
    return text(out), text(err), bytes(kept[status_fd]), exceeded, backstop


def _kill(proc: subprocess.Popen) -> None:
    """Kill the launcher's process group and reap it; in namespaces its death takes every process of the run."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
