"""The seccomp filter of every sandboxed program: calls it needs only to attack are refused, and so is every socket
family but Unix and IP. Compiled once per zygote with libseccomp (through ctypes) where it is installed, and
installed on each program with one ``prctl`` (no library to load under the program's memory limit); without
libseccomp, programs run without a filter. Imported by the launcher only (the standard library alone)."""

import ctypes
import os

DENIED = ("memfd_create", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev",
          "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "bpf", "perf_event_open", "userfaultfd",
          "io_uring_setup", "kexec_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
          "swapon", "swapoff", "reboot", "acct", "quotactl", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
          "open_tree", "mount_setattr")  # fmt: skip
# clone() may not make namespaces either (unshare by another name); clone3() passes its flags in memory, where a
# filter cannot look, so it answers ENOSYS and the C library falls back to clone()
CLONE_NAMESPACES = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
# the socket families a program may open (an allow-list: vsock, netlink, packet, bluetooth and the rest are refused)
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX; AF_INET and AF_INET6, which reach only the run's own network namespace
EPERM, EACCES, ENOSYS = 1, 13, 38
SCMP_CMP_EQ, SCMP_CMP_GT, SCMP_CMP_MASKED_EQ = 4, 6, 7
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
REQUIRED = ("clone", "clone3", "socket", "socketpair", "unshare", "mount")  # calls every architecture here has


def _check(result: int, what: str) -> None:
    if result != 0:  # libseccomp returns -errno
        raise OSError(-result, f"{what}: {os.strerror(-result)}")


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def compile_filter() -> bytes | None:
    """The filter, as the kernel's BPF program, built once per zygote with libseccomp (None where libseccomp is not
    installed): refusing with EPERM the calls a program needs only to attack, ``DENIED`` (anonymous memory files
    outside its limits, keyrings, debugging other processes, namespaces, mounts, kernel modules, BPF) and ``clone``
    with namespace flags; ``clone3`` with ENOSYS; and with EACCES every socket family but ``SOCKET_FAMILIES`` (vsock
    reaches the hypervisor, netlink the kernel, packet and bluetooth the hardware). Calls of another architecture
    (32-bit ``int 0x80``) kill the calling thread: libseccomp's default for a filter of the native architecture."""
    try:
        seccomp = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    seccomp.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    context = seccomp.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    refuse = lambda errno: 0x00050000 | errno  # noqa: E731 - SCMP_ACT_ERRNO(errno)

    def rule(name: str, errno: int, compare: _ArgCmp | None = None) -> None:
        number = seccomp.seccomp_syscall_resolve_name(name.encode())
        if number < 0 and name in REQUIRED:
            raise OSError(f"this libseccomp does not know {name}(): the filter would miss it (libseccomp >= 2.5)")
        if number >= 0:
            count = 0 if compare is None else 1
            _check(seccomp.seccomp_rule_add_array(context, refuse(errno), number, count, compare), f"seccomp {name}")

    try:
        for name in DENIED:
            rule(name, EPERM)
        for flag in CLONE_NAMESPACES:
            rule("clone", EPERM, _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule("clone3", ENOSYS)
        for name in ("socket", "socketpair"):
            for family in range(max(SOCKET_FAMILIES)):
                if family not in SOCKET_FAMILIES:
                    rule(name, EACCES, _ArgCmp(0, SCMP_CMP_EQ, family, 0))
            rule(name, EACCES, _ArgCmp(0, SCMP_CMP_GT, max(SOCKET_FAMILIES), 0))
        fd = os.memfd_create("seccomp_bpf", os.MFD_CLOEXEC)
        try:
            _check(seccomp.seccomp_export_bpf(context, fd), "seccomp export")
            os.lseek(fd, 0, os.SEEK_SET)
            program = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
        finally:
            os.close(fd)
    finally:
        seccomp.seccomp_release(context)
    return program


FILTER = compile_filter()  # in the zygote, once: a run only installs it


def install(program: bytes | None) -> bool:
    """Install ``program`` (``FILTER``) on this process, which must have ``no_new_privs`` set; False without one.
    A failure raises: the run must not go on unfiltered where a filter exists."""
    if program is None:
        return False
    code = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(code))  # struct sock_filter: 8 bytes each
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp: {os.strerror(errno)}")
    return True
