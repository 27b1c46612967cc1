"""The isolation levels, what the machine allows, and the command that starts a sandbox's zygote at a level.

``"namespaces"``: util-linux ``unshare`` gives the zygote a private mount namespace (and a user namespace where the
trainer is not root); each run then takes fresh PID, mount, network, IPC and UTS namespaces of its own (and its own
user namespace where the trainer is not root). ``"rlimits"``: resource limits, a scrubbed environment, a process
group, every capability dropped, ``no_new_privs``, a new session keyring and the seccomp filter (and, for a root
trainer, a uid of its own). ``"auto"`` takes namespaces where the kernel allows them and otherwise rlimits, with a
warning.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

ISOLATIONS = ("auto", "namespaces", "rlimits")
ZYGOTE = str(Path(__file__).with_name("zygote.py"))
# the directories a program sees, read-only (with the Python installation, added below)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
LOST_WITHOUT_NAMESPACES = (
    "the program can use the network, read and write every file the trainer's user can, see and signal the "
    "trainer's processes, and leave behind children that start their own session"
)


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be had on this machine; the message says why and what to do."""


def is_root() -> bool:
    return os.geteuid() == 0


def unshare_args() -> list[str]:
    """``unshare`` with every namespace a run takes (the probe of what the kernel allows); a non-root trainer also
    gets a user namespace, where it is root."""
    args = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--net",
        "--ipc",
        "--uts",
        "--propagation",
        "private",
    ]
    return args if is_root() else [*args, "--user", "--map-root-user"]


def zygote_unshare_args() -> list[str]:
    """``unshare`` and its flags for the zygote: a private mount namespace (and, for a non-root trainer, a user
    namespace where it is root); each run then takes its own PID, mount, network, IPC and UTS namespaces."""
    args = ["unshare", "--mount", "--propagation", "private"]
    return args if is_root() else [*args, "--user", "--map-root-user"]


@functools.cache
def namespaces_refusal() -> str | None:
    """Why namespaces cannot be used here (``None`` when they can): tried once per process, with a real mount."""
    if sys.platform != "linux":
        return f"Linux namespaces do not exist on {sys.platform}"
    if shutil.which("unshare") is None:
        return "util-linux `unshare` is not on PATH (Debian/Ubuntu: `apt install util-linux`)"
    probe = [
        *unshare_args(),
        sys.executable,
        "-I",
        "-S",
        "-c",
        "import ctypes; l = ctypes.CDLL(None, use_errno=True); "
        "raise SystemExit(l.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None))",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env={"PATH": os.defpath})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare` failed: {exc}"
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        return (
            f"the kernel refused new namespaces ({why}); unprivileged user namespaces may be disabled "
            "(`sysctl kernel.unprivileged_userns_clone=1`, or AppArmor's `kernel.apparmor_restrict_unprivileged_"
            "userns=0`), or a container's seccomp profile forbids `unshare`"
        )
    return None


@functools.cache
def seccomp_missing() -> str | None:
    """Why programs will run without the seccomp filter (None when libseccomp is there): warned about once."""
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return (
            "libseccomp is not installed, so sandboxed programs run without the seccomp filter: the calls and socket "
            "families it refuses (vsock, netlink, namespaces, keyrings, memfd_create) stay open to them. Install it "
            "(Debian/Ubuntu: `apt install libseccomp2`)."
        )
    return None


def resolve(isolation: str) -> str:
    """The level to use for ``isolation``: ``"auto"`` becomes the best available; an explicit level the machine
    cannot give raises ``SandboxUnavailable``."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}.")
    if isolation == "rlimits":
        return "rlimits"
    refusal = namespaces_refusal()
    if refusal is None:
        return "namespaces"
    if isolation == "namespaces":
        raise SandboxUnavailable(
            f"isolation='namespaces' is not available: {refusal}. Fix that, or pass isolation='rlimits' to accept "
            f"weaker isolation: {LOST_WITHOUT_NAMESPACES}."
        )
    warnings.warn(
        f"Sandboxed programs run with rlimits only, since namespaces are not available ({refusal}): "
        f"{LOST_WITHOUT_NAMESPACES}. Pass isolation='namespaces' to refuse instead.",
        RuntimeWarning,
        stacklevel=3,
    )
    return "rlimits"


def world_reachable(path: str) -> bool:
    """Whether a user with no relation to the file's owners can execute ``path`` (every folder above searchable)."""
    path = os.path.realpath(path)
    parts = Path(path).parents
    return os.stat(path).st_mode & 0o001 != 0 and all(os.stat(p).st_mode & 0o001 for p in parts)


def interpreter(isolation: str) -> str:
    """The Python that runs programs: the base installation, never a virtual environment's (whose packages include
    the trainer's). With rlimits under a root trainer the program runs as a uid of its own, which must be able to
    reach it; where the base Python sits in a private folder (pyenv under /root), the system's Python is used."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if isolation == "namespaces" or not is_root() or world_reachable(base):
        return base
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(candidate) and world_reachable(candidate):
            return os.path.realpath(candidate)
    raise SandboxUnavailable(
        f"isolation='rlimits' under a root trainer runs each program as an unprivileged uid of its own (root ignores "
        f"the process limit), and that uid cannot reach {base} (a folder above it is private) nor a system Python. "
        "Install Python where every user can run it, or run the trainer as a non-root user."
    )


def visible_dirs() -> list[str]:
    """What a program sees, read-only: the system directories and the base Python installation."""
    dirs = list(SYSTEM_DIRS)
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return dirs


def hidden_dirs() -> list[str]:
    """Installed packages and the trainer's own code, covered by empty mounts wherever a visible directory holds
    them: every site-packages, the virtual environment and the directory this package was imported from."""
    package_root = Path(__file__).resolve().parents[2]
    candidates = {
        *site.getsitepackages(),
        site.getusersitepackages(),
        sys.prefix,
        str(package_root),
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
        os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages"),
    }
    resolved = {os.path.realpath(p) for p in candidates if p}
    dirs = visible_dirs()
    return sorted(p for p in resolved if p not in dirs and any(p.startswith(d + "/") for d in dirs))
