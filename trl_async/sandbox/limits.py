"""What a sandboxed program may use, and what came back: ``Limits``, ``SandboxResult`` and the rule naming the limits
a run hit (``limits_hit``, a pure function)."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, fields

MIB = 1 << 20
# the largest value each limit takes: past these the kernel's own limits (pid_max, fs.nr_open, 63-bit sizes) or
# select()'s timeout refuse, and the run would fail for the caller's value rather than the program's behaviour
MAXIMA = {
    "wall_s": 86_400,
    "cpu_s": 86_400,
    "memory_mib": 1 << 40,
    "processes": 1 << 22,
    "output_bytes": 1 << 30,
    "file_mib": 1 << 40,
    "disk_mib": 1 << 40,
    "open_files": 1 << 20,
}
SECONDS = ("wall_s", "cpu_s")  # any finite number; every other limit is a whole count


@dataclass(frozen=True)
class Limits:
    """Per-run limits. CPU time counts every process of the run together; memory and file size are per process;
    ``processes`` counts every process of the run at once; ``disk_mib`` caps everything written under the working
    directory and ``/tmp`` together (namespaces only). A value out of range raises ``ValueError`` naming it.

    Attributes:
        wall_s: Wall-clock seconds, then every process of the run is killed.
        cpu_s: CPU seconds of all the run's processes together, then every process of the run is killed.
        memory_mib: Address space per process, in MiB.
        processes: Processes and threads at once (fork bombs stop here).
        output_bytes: Bytes of stdout and of stderr, each; more ends the run.
        file_mib: The largest file it may write, in MiB.
        disk_mib: The working directory plus ``/tmp``, in MiB.
        open_files: Open file descriptors per process.
    """

    wall_s: float = 10.0
    cpu_s: float = 10
    memory_mib: int = 512
    processes: int = 32
    output_bytes: int = 64 * 1024
    file_mib: int = 16
    disk_mib: int = 64
    open_files: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = limit_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"Limits.{f.name} {problem}")

    def rlimits(self) -> dict[str, int]:
        """The values the launcher sets with ``setrlimit``. CPU time per process is a backstop past the run's
        budget (rounded up, plus a second): the launcher, which watches the whole run, stops it at the budget first,
        and so sees it stopped (a process the kernel stops is seen only by its parent)."""
        return {
            "cpu_s": math.ceil(self.cpu_s) + 1,
            "memory_bytes": self.memory_mib * MIB,
            "processes": self.processes,
            "file_bytes": self.file_mib * MIB,
            "open_files": self.open_files,
        }


def limit_problem(name: str, value) -> str | None:
    """What is wrong with ``value`` for the limit ``name`` (with the fix), or None."""
    kind = "a number of seconds" if name in SECONDS else "a whole number"
    allowed = (int, float) if name in SECONDS else (int,)
    if isinstance(value, bool) or not isinstance(value, allowed):
        return f"must be {kind}, got {value!r} ({type(value).__name__})" + (
            f"; pass {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        )
    if not math.isfinite(value) or value <= 0:
        return f"must be a finite number above 0, got {value!r}."
    if value > MAXIMA[name]:
        return f"must be at most {MAXIMA[name]}, got {value!r}."
    return None


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9, ``SIGRTMIN+6`` for a real-time signal, ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except (ValueError, TypeError):
        pass
    low, high = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
    if isinstance(number, int) and low <= number <= high:
        return f"SIGRTMIN+{number - low}"
    return f"signal {number!r}"


@dataclass(frozen=True)
class SandboxResult:
    """One run. ``limits`` names the limits it hit (``"wall_time"``, ``"cpu_time"``, ``"memory"``, ``"processes"``,
    ``"output"``, ``"file_size"``, ``"disk"``); ``ok`` means exit status 0 with none hit.

    Attributes:
        exit_code: The exit status; ``None`` when a signal ended the run, or when the sandbox killed it.
        signal: The signal that ended the run, or ``None``.
        stdout: What the program wrote to its standard output (UTF-8, invalid bytes replaced).
        stderr: What it wrote to its standard error, with the sandbox's own notes appended.
        limits: The limits the run hit, in the names above.
        seconds: Wall-clock seconds the run took.
        isolation: The isolation level it ran under: ``"namespaces"`` or ``"rlimits"``.
    """

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    limits: tuple[str, ...]
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        """Exit status 0 and no limit hit."""
        return self.exit_code == 0 and not self.limits

    @property
    def timed_out(self) -> bool:
        """The wall-clock or the CPU-time limit stopped the run."""
        return "wall_time" in self.limits or "cpu_time" in self.limits

    def summary(self) -> str:
        """One line: how it ended and why."""
        if self.limits:
            return "stopped: " + ", ".join(LIMIT_TEXT.get(name, str(name)) for name in self.limits)
        if self.signal is not None:
            return f"killed by {signal_name(self.signal)}"
        return f"exit status {self.exit_code}"


LIMIT_TEXT = {
    "wall_time": "wall-clock limit",
    "cpu_time": "CPU-time limit",
    "memory": "memory limit",
    "processes": "process limit",
    "output": "output limit",
    "file_size": "file-size limit",
    "disk": "disk limit",
}

# what a process prints when a limit refuses it: Python's exception names and the C library's error strings
_MARKERS = (
    ("memory", ("MemoryError", "Cannot allocate memory", "std::bad_alloc")),
    ("processes", ("BlockingIOError", "Resource temporarily unavailable", "can't start new thread")),
    ("file_size", ("File too large",)),
    ("disk", ("No space left on device", "Disk quota exceeded")),
)


def limits_hit(
    *,
    timed_out: bool,
    output_exceeded: bool,
    signal_number: int | None,
    stderr: str,
    cpu_s: float = 0.0,
    cpu_limit_s: float = float("inf"),
    disk_full: bool = False,
) -> tuple[str, ...]:
    """The limits a run hit, from what the launcher and the reader saw and the program's error output.

    The sandbox sees the wall clock, the output cap, the CPU time of every process of the run (``cpu_s``, summed
    over all of them when the run ends, so a child stopped by the limit counts even when its parent exits 0) and
    whether the run's disk filled (``disk_full``); the others show only in how the refused call failed, so they are
    read from stderr, which a program can also print on purpose, or hide: a report, not a proof."""
    hit = []
    if timed_out:
        hit.append("wall_time")
    if output_exceeded:
        hit.append("output")
    if signal_number == signal.SIGXCPU or cpu_s >= cpu_limit_s:
        hit.append("cpu_time")
    if signal_number == signal.SIGXFSZ:
        hit.append("file_size")
    if disk_full:
        hit.append("disk")
    hit += [name for name, markers in _MARKERS if name not in hit and any(m in stderr for m in markers)]
    return tuple(hit)
