"""A run's filesystem (namespaces only), built by its launcher in the run's own mount namespace: a small tmpfs
holding read-only bind mounts of the system directories and the Python installation, empty read-only mounts over
every ``site-packages`` and the trainer's own paths, a few device nodes, a ``/proc`` of the run's PID namespace (its
``/proc/sys`` read-only), and one size-capped tmpfs shared by ``/sandbox`` and ``/tmp``; then ``chroot`` into it."""

import ctypes
import os

from libc import LIBC, check

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
MNT_DETACH = 2
DEVICES = ("null", "zero", "full", "random", "urandom")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _kept_flags(path: str) -> int:
    """The flags of the mount holding ``path`` that a read-only remount must keep (a user namespace may not drop
    them)."""
    f = os.statvfs(path).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    )
    return sum(ms for st, ms in pairs if f & st)


def _mount_points_under(path: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(path.rstrip("/") + "/"):
                points.append(point)
    return sorted(points)


def bind_read_only(source: str, target: str) -> None:
    """Bind ``source`` (with the mounts below it) at ``target``, every one of them read-only and nosuid."""
    mount(source, target, None, MS_BIND | MS_REC)
    for point in [target, *_mount_points_under(target)]:
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | _kept_flags(point))
        except OSError:
            if not os.statvfs(point).f_flag & os.ST_RDONLY:
                raise  # a mount the program could write to


def build_root(spec: dict) -> None:
    root, uid = spec["root"], spec["uid"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in spec["binds"]:
        if not os.path.lexists(path):
            continue
        inside = root + path
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
            bind_read_only(path, inside)
    for path in spec["hide"]:
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=555")
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.symlink("/tmp", root + "/dev/shm")
    os.mkdir(root + "/proc")
    try:  # refused where the outer /proc is partly masked (some containers); Python runs without it
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    else:  # the run's IPC limits (/proc/sys/kernel/shm*) belong to its own root: read-only, so they stay as set
        bind_read_only(root + "/proc/sys", root + "/proc/sys")
    scratch = root + "/.scratch"
    os.mkdir(scratch)
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_bytes']},mode=755")
    for name, mode in (("sandbox", 0o700), ("tmp", 0o1777)):
        os.mkdir(scratch + "/" + name)
        os.chmod(scratch + "/" + name, mode)
        os.mkdir(root + "/" + name)
        mount(scratch + "/" + name, root + "/" + name, None, MS_BIND)
    if spec["drop_uid"]:
        os.chown(root + "/sandbox", uid, uid)
    check(LIBC.umount2(scratch.encode(), MNT_DETACH), "umount scratch")
    os.rmdir(scratch)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    limit_shared_memory(spec["disk_bytes"])
    os.chroot(root)
    os.chdir("/")


def limit_shared_memory(size: int) -> None:
    """System V shared memory lives outside every process's address space: in this run's own IPC namespace, cap it
    at ``size`` bytes in all."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name, value in (("shmmax", size), ("shmall", max(1, size // page)), ("shmmni", 16)):
        with open(f"/proc/sys/kernel/{name}", "w") as f:
            f.write(str(value))
