"""The sandbox's long-lived first process: one per ``Sandbox``, it forks a launcher for each run, so that a run
costs a fork and fresh namespaces rather than a new interpreter.

Run as a file (``python -I -S zygote.py <socket fd>``): with namespaces under util-linux ``unshare`` (a private mount
namespace, and a user namespace where the trainer is not root), otherwise as a plain child of the trainer. It reads
requests from a Unix ``SOCK_SEQPACKET`` socket, each one byte carrying five descriptors: a memfd holding the run's
spec (``marshal``), the program's stdout and stderr, the status pipe and the trainer's end-of-life (``alive``) pipe.
For each it forks; with namespaces the child takes fresh mount, PID, network, IPC and UTS namespaces and forks again,
so that the run's launcher (``launcher.run``) is PID 1 of its own PID namespace; where the trainer is not root, the
run also gets a user namespace of its own inside the zygote's.

It writes one byte on the socket once ready, and reaps every launcher (it is a child subreaper). When the trainer's
end of the socket closes it reaps the launchers still on their way out, then exits (runs still in flight end by
themselves when their alive pipes close).
"""

import marshal
import os
import select
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launcher  # noqa: E402
import libc  # noqa: E402

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER = 0x20000, 0x4000000, 0x8000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
RUN_NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE = 36, 4
LAST_REAP_S = 2.0  # at its end, how long the zygote waits for launchers still running before it leaves them


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def own_user_namespace() -> None:
    """Where the trainer is not root: a user namespace of the run's own, where it is root (uid and gid 0 mapped to
    the zygote's), so that per-user counts (``RLIMIT_NPROC``, pending signals, inotify) are the run's alone."""
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def start_run(sock: socket.socket, fds: list[int]) -> None:
    """Fork the run's launcher (in the child: never returns)."""
    spec_fd, stdout_fd, stderr_fd, status_fd, alive_fd = fds
    try:
        if os.fork():
            return
    except OSError as exc:  # no process for the run: its report says so, the zygote goes on
        report_setup_error(status_fd, exc)
        return
    try:
        sock.close()
        spec = marshal.loads(read_all(spec_fd))
        os.close(spec_fd)
        if spec["isolation"] == "namespaces":
            user = CLONE_NEWUSER if spec["own_user_namespace"] else 0
            libc.check(libc.LIBC.unshare(RUN_NAMESPACES | user), "unshare")
            if user:
                own_user_namespace()
            if os.fork():  # the next child is PID 1 of the new PID namespace; this one's work is done
                os._exit(0)
        else:
            os.setsid()
        launcher.run(spec, stdout_fd, stderr_fd, status_fd, alive_fd)
    except BaseException as exc:  # noqa: BLE001 - reported as the sandbox's failure, not the program's
        report_setup_error(status_fd, exc)
    os._exit(0)


def report_setup_error(status_fd: int, exc: BaseException) -> None:
    try:
        os.write(status_fd, marshal.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}))
    except OSError:
        pass


def reap(deadline: float = 0.0) -> None:
    """Reap every launcher that has ended, and wait for those still running until ``deadline`` (default: none).
    Before the zygote leaves, this reaps the launchers of finished runs still on their way out (a run still in
    flight at the deadline ends by itself when its alive pipe closes): a launcher left unreaped would go to the
    machine's init, which may keep it as a zombie for long."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)


def serve(sock: socket.socket) -> None:
    sock.send(b"r")
    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        reap()
        if not ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, 16, 8)
        except OSError:
            message, fds = b"", []
        if not message:  # the trainer is gone
            reap(time.monotonic() + LAST_REAP_S)
            return
        if len(fds) == 5:
            start_run(sock, fds)
        for fd in fds:
            os.close(fd)


def main() -> None:
    libc.LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for number in launcher.SHIELDED:
        launcher.signal.signal(number, launcher.signal.SIG_IGN)
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
