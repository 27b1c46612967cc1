"""One sandboxed run, from its first process: builds the program's world, starts it, enforces its wall clock and CPU
budget, reports, cleans up.

Imported by ``zygote.py``, whose fresh fork runs ``run`` once per run; it imports nothing outside the standard
library (and this folder's ``libc``, ``root``, ``syscall_filter`` and ``python_here``), so it never loads the
trainer's code. With ``"namespaces"`` it runs as the init process (pid 1) of fresh PID, mount, network, IPC and UTS
namespaces; with ``"rlimits"`` as a plain process.

Steps, in order:
1. (namespaces) the run's filesystem (``root.py``), then ``chroot`` into it.
2. The program's files and stdin.
3. A child that sets resource limits, drops privileges (another uid when the launcher is real root; in every case
   every capability, and ``no_new_privs``), installs the seccomp filter, then executes the program with a scrubbed
   environment, or, for ``run_python``, runs it in this interpreter (``python_here``).
4. Wait for it until the wall clock runs out, the run's processes together have used their CPU time, or the
   trainer's end of the ``alive`` pipe closes; then kill everything left (in its own PID namespace: every process but
   this one; otherwise every process of the run's uid, or its process group), reap it all (the launcher is a child
   subreaper, so orphans come back to it, and every process's CPU time adds up in its own), and write
   ``{"exit", "signal", "timed_out", "cpu_stopped", "cpu_s", "seconds", "disk_full"}`` (marshal) to the status
   pipe. A setup failure, the program's start included (before its ``execve``), writes ``{"setup_error": ...}``.
"""

import _signal as signal
import ctypes
import marshal
import os
import resource
import select
import time

import libc  # this folder's, on sys.path through zygote.py
import python_here
import syscall_filter
from root import build_root

PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 38, 28, 24, 4, 36
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECBIT_NOROOT_ALL = 0x3 | 0xC | 0x30  # noroot, no_setuid_fixup, keep_caps_locked (each with its lock)
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}
# signals a program running as the launcher's own uid (a non-root trainer's) could send it; ignored by the launcher
SHIELDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)
LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}

POLL_MAX_S = 0.25  # the longest the run's CPU time goes unchecked once its first check is due
REAP_S = 5.0  # how long the launcher keeps killing and reaping what the program left before it reports anyway
_libc, _check = libc.LIBC, libc.check


def write_files(spec: dict, workdir: str) -> None:
    for name, text in spec["files"].items():
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(text)
        if spec["drop_uid"]:
            os.chown(path, spec["uid"], spec["uid"])
    if spec["drop_uid"]:
        os.chown(workdir, spec["uid"], spec["uid"])
        for dirpath, dirnames, _ in os.walk(workdir):
            for d in dirnames:
                os.chown(os.path.join(dirpath, d), spec["uid"], spec["uid"])


def stdin_fd(data: bytes) -> int:
    fd = os.memfd_create("stdin", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def new_session_keyring() -> None:
    """An empty session keyring of its own: the trainer's (tokens, Kerberos tickets) is no longer reachable."""
    number = KEYCTL_SYSCALL.get(os.uname().machine)
    if number is not None:
        _libc.syscall(number, 1, None)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous


class _CapHeader(ctypes.Structure):  # struct __user_cap_header_struct
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):  # struct __user_cap_data_struct
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(spec: dict) -> None:
    """Everything that only takes away: no capability is held now (not only after an exec: ``run_python`` runs the
    program without one), and none can be regained."""
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability; EPERM without CAP_SETPCAP
    if spec["drop_uid"]:
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    elif spec["isolation"] == "namespaces":  # root of a user namespace: uid 0 must not bring capabilities back
        _check(_libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_ALL, 0, 0, 0), "securebits")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()), "capset")  # version 3, all 0
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    held = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(_CapHeader(0x20080522, 0)), held), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in held):
        raise OSError("capabilities are still held after dropping them all")


def start_program(spec: dict, workdir: str, status_fd: int) -> int:
    """Fork the program and return its pid once it has reached ``execve``. Whatever fails before that (a limit the
    kernel refuses, a missing ``argv[0]``) raises here: the caller's or the machine's fault, never the program's."""
    failed_r, failed_w = os.pipe()  # close-on-exec: it reads empty once the program is running
    pid = os.fork()
    if pid:
        os.close(failed_w)
        with os.fdopen(failed_r, "rb") as failed:
            why = failed.read().decode(errors="replace")
        if why:
            os.waitpid(pid, 0)
            raise OSError(f"the program could not start: {why}")
        return pid
    try:
        os.close(failed_r)
        os.close(status_fd)
        os.close(spec["alive_fd"])
        if spec["isolation"] == "rlimits":
            os.setpgid(0, 0)
        os.chdir(workdir)
        fd = stdin_fd(spec["stdin"])
        os.dup2(fd, 0)
        os.close(fd)
        for key, which in LIMITS.items():
            value = spec["limits"][key]
            hard = value + 1 if key == "cpu_s" else value  # SIGXCPU at the soft limit, SIGKILL a second later
            resource.setrlimit(which, (value, hard))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for number in (signal.SIGPIPE, *SHIELDED):
            signal.signal(number, signal.SIG_DFL)
        new_session_keyring()
        drop_privileges(spec)
        syscall_filter.install(syscall_filter.FILTER)
        if spec.get("python_main"):  # run_python: this interpreter runs it, as a new one would
            main, env, argv = spec["python_main"], spec["env"], spec["argv"]
            spec.clear()  # the frames above stay reachable to the program: they keep nothing of the spec
            os.close(failed_w)
            _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
            python_here.run(main, env, argv, os.path.dirname(os.path.abspath(__file__)))
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which reports a setup error
        os.write(failed_w, f"{type(exc).__name__}: {exc}".encode(errors="replace"))
    os._exit(127)


def _stat_fields(pid: str) -> list[bytes]:
    """``/proc/<pid>/stat`` after the command name: index 0 is field 3 (state), index n is field n + 3."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def run_cpu_s(spec: dict, pid: int) -> float:
    """CPU seconds the run has used so far: its processes already reaped here, plus every live one's own time and
    the time of the children it reaped (``cutime``, ``cstime``). Live processes are those of this PID namespace,
    else of the run's uid (a root trainer), else of the program's process group."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    ticks, me = 0, os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if spec["isolation"] != "namespaces" and spec["drop_uid"] and real_uid(entry) != spec["uid"]:
                continue
            fields = _stat_fields(entry)
            if spec["isolation"] != "namespaces" and not spec["drop_uid"] and int(fields[2]) != pid:
                continue
            ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile: its time is in its parent's now
    return reaped.ru_utime + reaped.ru_stime + ticks / os.sysconf("SC_CLK_TCK")


def wait_for(spec: dict, pid: int, deadline: float, alive_fd: int) -> tuple[int | None, str | None]:
    """``(wait status, why it was cut short)`` of the program, reaping any orphan re-parented here meanwhile. The
    status is None, and ``why`` says so, at the wall clock (``"wall"``), once the run's CPU time reaches its budget
    (``"cpu"``, checked no sooner than all cores together could have used it), or when ``alive_fd`` (the trainer's
    end of a pipe) closes (``"trainer"``)."""
    pidfd = os.pidfd_open(pid)
    budget, cores = spec["cpu_s"], os.cpu_count() or 1  # all of them: a program may widen its own affinity
    check = time.monotonic() + budget / cores
    while True:
        now = time.monotonic()
        if now >= deadline:
            return None, "wall"
        if now >= check:
            used = run_cpu_s(spec, pid)
            if used >= budget:
                return None, "cpu"
            check = now + min(POLL_MAX_S, max(0.02, (budget - used) / cores))
        ready, _, _ = select.select([pidfd, alive_fd], [], [], min(deadline, check) - now)
        if alive_fd in ready:
            return None, "trainer"
        while True:
            try:
                reaped, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None, None
            if reaped == pid:
                return status, None
            if reaped == 0:
                break


def disk_full(spec: dict) -> bool:
    """Whether the run's shared tmpfs (working directory and ``/tmp``, namespaces only) ended full."""
    if spec["isolation"] != "namespaces":
        return False
    try:
        return os.statvfs("/sandbox").f_bavail == 0
    except OSError:
        return False


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the run's own uid), from a child that takes that uid: ``kill(-1)`` reaches
    all of them, new sessions included, and the child itself."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def real_uid(pid: str) -> int:
    """The real uid of a process (``/proc/<pid>``'s owner is root for a process that is not dumpable)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise ValueError("no Uid line")


def _owned_by(uid: int) -> bool:
    """Whether a live (not zombie) process of ``uid`` remains."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and real_uid(entry) == uid and _stat_fields(entry)[0] != b"Z":
                return True
        except (OSError, IndexError, ValueError):
            pass
    return False


def kill_all(spec: dict, pid: int) -> None:
    """Kill whatever the program left: in its PID namespace every process but this one; otherwise every process of
    its uid (a root trainer) or of its process group."""
    try:
        if spec["isolation"] == "namespaces":
            os.kill(-1, signal.SIGKILL)  # as PID 1: every other process of this namespace
        elif spec["drop_uid"]:
            for _ in range(100):  # a fork racing the sweep can survive one pass
                _kill_uid(spec["uid"])
                if not _owned_by(spec["uid"]):
                    break
        else:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        pass
    reap_all(time.monotonic() + REAP_S)


def reap_all(deadline: float) -> None:
    """Reap every child (orphans come here), SIGKILLing any still alive (one that escaped its process group with
    ``setsid``), until none is left or the deadline passes."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            return
        for child in children():
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(_stat_fields(entry)[1]) == me:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return found


def run(spec: dict, stdout_fd: int, stderr_fd: int, status_fd: int, alive_fd: int) -> None:
    """One run, from a fresh fork of the zygote (with namespaces, PID 1 of the run's own PID namespace): the
    program's output goes to ``stdout_fd`` and ``stderr_fd``, the report to ``status_fd``."""
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in (stdout_fd, stderr_fd):
        os.close(fd)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the program come here, to be killed and reaped
    spec["alive_fd"] = alive_fd  # one dict, so that the program's process can clear it for every frame
    try:
        if spec["isolation"] == "namespaces":
            build_root(spec)
            workdir = "/sandbox"
        else:
            workdir = spec["root"]
        write_files(spec, workdir)
        start = time.monotonic()
        pid = start_program(spec, workdir, status_fd)
    except BaseException as exc:  # noqa: BLE001
        os.write(status_fd, marshal.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}))
        return
    status, cut = wait_for(spec, pid, start + spec["wall_s"], spec["alive_fd"])
    kill_all(spec, pid)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run, now that all are reaped
    report = {
        "timed_out": cut == "wall",
        "cpu_stopped": cut == "cpu",
        "exit": None,
        "signal": None,
        "seconds": time.monotonic() - start,
        "cpu_s": reaped.ru_utime + reaped.ru_stime,
        "disk_full": disk_full(spec),
    }
    if status is not None:
        if os.WIFSIGNALED(status):
            report["signal"] = os.WTERMSIG(status)
        else:
            report["exit"] = os.WEXITSTATUS(status)
    os.write(status_fd, marshal.dumps(report))
