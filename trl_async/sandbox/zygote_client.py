"""The trainer's end of a sandbox's zygote (``zygote.py``): started on the first run, restarted if it died, and
handed each run's descriptors over a Unix socket."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import weakref

from .isolation import ZYGOTE, zygote_unshare_args

READY_TIMEOUT_S = 60.0
ZYGOTE_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # the programs' locale: the same stdio
SEND_TIMEOUT_S = 30.0  # a zygote that takes no run for this long is replaced
_ZYGOTES: weakref.WeakSet = weakref.WeakSet()


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the message says where."""


class Zygote:
    """One zygote process at a time, shared by every thread of its ``Sandbox``."""

    def __init__(self, isolation: str) -> None:
        self.isolation = isolation
        self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # the zygote's interpreter
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._finalizer: weakref.finalize | None = None
        _ZYGOTES.add(self)

    def start_run(self, spec: bytes, stdout_fd: int, stderr_fd: int, status_fd: int, alive_fd: int) -> None:
        """Hand one run to the zygote; its report arrives on ``status_fd``. The descriptors stay the caller's."""
        spec_fd = os.memfd_create("trl_async_sandbox_spec", os.MFD_CLOEXEC)
        try:
            view = memoryview(spec)
            while view:
                view = view[os.write(spec_fd, view) :]
            os.lseek(spec_fd, 0, os.SEEK_SET)
            fds = [spec_fd, stdout_fd, stderr_fd, status_fd, alive_fd]
            with self._lock:
                for attempt in range(2):
                    if self._proc is None or self._proc.poll() is not None:
                        self._start()
                    try:
                        socket.send_fds(self._sock, [b"r"], fds)
                        return
                    except OSError as exc:  # the zygote died since: start another, once
                        self._stop()
                        if attempt:
                            raise SandboxError(f"the sandbox's zygote does not take runs: {exc}") from exc
        finally:
            os.close(spec_fd)

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launch = [self.python, "-I", "-S", ZYGOTE, str(theirs.fileno())]
        command = [*zygote_unshare_args(), "--", *launch] if self.isolation == "namespaces" else launch
        try:
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, pass_fds=(theirs.fileno(),),
                                          env=ZYGOTE_ENV, start_new_session=True)  # fmt: skip
        except OSError as exc:
            raise SandboxError(f"could not start the sandbox's zygote: {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, ours)  # at exit too: the zygote is reaped
        ready, _, _ = select.select([ours], [], [], READY_TIMEOUT_S)
        try:
            said = ours.recv(1) if ready else b""
        except OSError:
            said = b""
        ours.settimeout(SEND_TIMEOUT_S)
        if said != b"r":
            self._proc.kill()
            why = self._proc.communicate()[1].decode(errors="replace").strip()
            self._stop()
            raise SandboxError(f"the sandbox's zygote did not start: {why[-2000:] or 'no reply'}")
        self._proc.stderr.close()  # it has nothing more to say; a full pipe must never block it

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._proc, self._sock, self._finalizer = None, None, None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _forget_in_child(self) -> None:
        """In a forked copy of the trainer: this process's copy of the socket closes (the zygote must still see the
        trainer's end close), and a run here starts a zygote of its own."""
        self._lock = threading.Lock()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._sock is not None:
            self._sock.close()
        self._proc, self._sock, self._finalizer = None, None, None


def _shutdown(proc: subprocess.Popen, sock: socket.socket) -> None:
    """Close the zygote's socket (it exits when it sees this) and reap it."""
    sock.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr and not proc.stderr.closed:
        proc.stderr.close()


def _after_fork_in_child() -> None:
    for zygote in list(_ZYGOTES):
        zygote._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
