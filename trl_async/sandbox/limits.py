"""What a sandboxed program may use, and what came back: ``Limits``, ``SandboxResult`` and the rule naming the limits
a run hit (``limits_hit``, a pure function)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, fields

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Memory and file size are per process; ``processes`` counts every process of the run;
    ``disk_mib`` caps everything written under the working directory and ``/tmp`` together (namespaces only)."""

    wall_s: float = 10.0  # wall clock, then every process of the run is killed
    cpu_s: int = 10  # CPU seconds per process (SIGXCPU)
    memory_mib: int = 512  # address space per process
    processes: int = 32  # processes and threads at once (fork bombs stop here)
    output_bytes: int = 64 * 1024  # stdout and stderr, each; more kills the run
    file_mib: int = 16  # the largest file it may write
    disk_mib: int = 64  # working directory plus /tmp
    open_files: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{f.name} must be a positive number, got {value!r}.")

    def rlimits(self) -> dict[str, int]:
        """The values the launcher sets with ``setrlimit``."""
        return {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": int(self.memory_mib * MIB),
            "processes": int(self.processes),
            "file_bytes": int(self.file_mib * MIB),
            "open_files": int(self.open_files),
        }


@dataclass(frozen=True)
class SandboxResult:
    """One run. ``limits`` names every limit it hit (``"wall_time"``, ``"cpu_time"``, ``"memory"``, ``"processes"``,
    ``"output"``, ``"file_size"``, ``"disk"``); ``ok`` means exit status 0 with none hit."""

    exit_code: int | None  # None when a signal ended it, or when the sandbox killed it
    signal: int | None
    stdout: str
    stderr: str
    limits: tuple[str, ...]
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.limits

    @property
    def timed_out(self) -> bool:
        return "wall_time" in self.limits or "cpu_time" in self.limits

    def summary(self) -> str:
        """One line: how it ended and why."""
        if self.limits:
            return "stopped: " + ", ".join(LIMIT_TEXT[name] for name in self.limits)
        if self.signal is not None:
            return f"killed by signal {signal.Signals(self.signal).name}"
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
) -> tuple[str, ...]:
    """The limits a run hit, from what the launcher and the reader saw and the program's error output.

    The sandbox knows the wall clock and the output cap itself; CPU time shows as SIGXCPU, or as a SIGKILL after
    ``cpu_s`` reached ``cpu_limit_s`` (the hard limit, a second after SIGXCPU); the others show only in how the refused
    call failed, so they are read from stderr, which a program can also print on purpose: a report, not a proof."""
    hit = []
    if timed_out:
        hit.append("wall_time")
    if output_exceeded:
        hit.append("output")
    if signal_number == signal.SIGXCPU or (signal_number == signal.SIGKILL and cpu_s >= cpu_limit_s):
        hit.append("cpu_time")
    if signal_number == signal.SIGXFSZ:
        hit.append("file_size")
    hit += [name for name, markers in _MARKERS if name not in hit and any(m in stderr for m in markers)]
    return tuple(hit)
