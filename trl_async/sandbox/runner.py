"""``Sandbox``: runs untrusted programs, each in a fresh sandbox, a bounded number at once, from any thread."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from .isolation import LAUNCHER, hidden_dirs, interpreter, is_root, resolve, unshare_args, visible_dirs
from .limits import Limits, SandboxResult, limits_hit

PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
BACKSTOP_S = 10.0  # past the wall clock, the trainer kills a launcher that has not reported
# a root trainer runs each program as its own uid, UID_BASE + MAX_CONCURRENCY * (pid % 2**16) + slot, which nothing
# else on the machine owns: the process limit counts only that run, and killing the uid's processes ends all of it
UID_BASE, MAX_CONCURRENCY = 0x50000000, 1024


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the message says where."""


def _check_files(files: Mapping[str, str]) -> None:
    for name in files:
        parts = name.split("/")
        if not name or name.startswith("/") or ".." in parts or "" in parts:
            raise ValueError(f"a sandbox file name must be a relative path inside the working directory, got {name!r}")


class Sandbox:
    """Runs programs in fresh sandboxes: ``run`` for a command, ``run_python`` for source; ``map_python`` runs many.

    ``isolation``: ``"auto"`` (namespaces where the kernel allows them, else rlimits with a warning),
    ``"namespaces"`` (refuse to run without them) or ``"rlimits"``. ``concurrency``: runs at once (default: the
    usable cores); a call beyond it waits in its own thread, so reward and tool threads queue and the trainer's main
    thread never does.
    """

    def __init__(self, limits: Limits | None = None, isolation: str = "auto", concurrency: int | None = None) -> None:
        if concurrency is not None and not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be between 1 and {MAX_CONCURRENCY}, got {concurrency}.")
        self.limits = limits or Limits()
        self.isolation = resolve(isolation)
        self.concurrency = concurrency or min(len(os.sched_getaffinity(0)), MAX_CONCURRENCY)
        self._slots: list[int] = list(range(self.concurrency))
        self._free = threading.Condition()
        self._python = interpreter(self.isolation)
        self._visible, self._hidden = visible_dirs(), hidden_dirs()

    def run_python(
        self, source: str, *, files: Mapping[str, str] | None = None, stdin: str = "", limits: Limits | None = None
    ) -> SandboxResult:
        """Run Python ``source`` as ``main.py`` in the working directory, with the base interpreter in isolated mode
        (no site-packages: the standard library only)."""
        return self.run(
            [self._python, "-I", "-S", "main.py"],
            files={**(files or {}), "main.py": source},
            stdin=stdin,
            limits=limits,
        )

    def map_python(self, sources: Sequence[str], *, limits: Limits | None = None) -> list[SandboxResult]:
        """``run_python`` for each source, ``concurrency`` at once; results in order."""
        if not sources:
            return []
        with ThreadPoolExecutor(min(self.concurrency, len(sources)), thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda s: self.run_python(s, limits=limits), sources))

    def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, str] | None = None,
        stdin: str = "",
        limits: Limits | None = None,
    ) -> SandboxResult:
        """Run ``argv`` (``argv[0]`` an absolute path inside the sandbox) in a fresh working directory holding
        ``files`` (relative name -> text). Blocks the calling thread until it ends."""
        files = dict(files or {})
        _check_files(files)
        if not argv or not str(argv[0]).startswith("/"):
            raise ValueError(f"argv[0] must be an absolute path, got {list(argv)[:1]!r}")
        slot = self._take_slot()
        try:
            return self._run([str(a) for a in argv], files, stdin, limits or self.limits, slot)
        finally:
            with self._free:
                self._slots.append(slot)
                self._free.notify()

    def _take_slot(self) -> int:
        with self._free:
            while not self._slots:
                self._free.wait()
            return self._slots.pop()

    def _spec(self, argv, files, stdin, limits: Limits, slot: int, root: str, status_fd: int) -> dict:
        return {
            "isolation": self.isolation,
            "root": root,
            "argv": argv,
            "files": files,
            "stdin": stdin,
            "env": {**PROGRAM_ENV, "HOME": "/sandbox" if self.isolation == "namespaces" else root, "TMPDIR": "/tmp"},
            "limits": limits.rlimits(),
            "wall_s": limits.wall_s,
            "disk_bytes": int(limits.disk_mib * (1 << 20)),
            "binds": self._visible,
            "hide": self._hidden,
            "status_fd": status_fd,
            "drop_uid": is_root(),
            "uid": UID_BASE + MAX_CONCURRENCY * (os.getpid() % (1 << 16)) + slot,
        }

    def _run(self, argv, files, stdin, limits: Limits, slot: int) -> SandboxResult:
        root = tempfile.mkdtemp(prefix="trl_async_sandbox_")
        status_r, status_w = os.pipe()
        launch = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "-I", "-S", LAUNCHER]
        command = [*unshare_args(), "--", *launch] if self.isolation == "namespaces" else launch
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        except OSError as exc:
            os.close(status_r)
            os.close(status_w)
            shutil.rmtree(root, ignore_errors=True)
            raise SandboxError(f"could not start the sandbox launcher: {exc}") from exc
        os.close(status_w)
        try:
            spec = self._spec(argv, files, stdin, limits, slot, root, status_w)
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
            streams = _read(proc, status_r, limits.output_bytes, started + limits.wall_s + BACKSTOP_S)
        finally:
            _kill(proc)
            os.close(status_r)
            shutil.rmtree(root, ignore_errors=True)
        stdout, stderr, status, exceeded, backstop = streams
        report = _report(status, backstop, proc.returncode, stderr)
        return SandboxResult(
            exit_code=None if exceeded else report["exit"],
            signal=None if exceeded else report["signal"],
            stdout=stdout,
            stderr=stderr,
            limits=limits_hit(
                timed_out=report["timed_out"], output_exceeded=exceeded, signal_number=report["signal"], stderr=stderr
            ),
            seconds=report.get("seconds", time.monotonic() - started),
            isolation=self.isolation,
        )


def _report(status: bytes, backstop: bool, returncode: int | None, stderr: str) -> dict:
    if backstop:
        return {"timed_out": True, "exit": None, "signal": None}
    try:
        report = json.loads(status) if status else None
    except json.JSONDecodeError:
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
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                backstop = True
                break
            for key, _ in sel.select(left):
                if key.fd not in sel.get_map():
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
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
