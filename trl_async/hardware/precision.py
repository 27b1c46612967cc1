"""What the hardware computes fast: whether bf16 and fp16 are native on a device.

One place answers it for the trainer's construction warning, the rollout workers' default dtype, the recipes and the
benchmarks. ``native_precision`` is a pure function of the device type, the CPU architecture and its capability
flags (unit-tested on the flag combinations of real CPUs and GPUs); ``device_precision`` reads them off this machine.

Why flags and not a timed probe: the answer is needed at construction, before any model is loaded, and must be the
same on a busy machine as on a quiet one; a probe of a few milliseconds is noisy on 2 shared cores, and the flags
are exactly what oneDNN dispatches on (``torch.cpu._is_avx512_bf16_supported`` is the same test).
``benchmarks/forward_backward.py`` measures what the choice is worth on a machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

X86 = ("x86_64", "amd64", "i386", "i686", "x86")
ARM = ("aarch64", "arm64", "armv8l", "armv9l")
# per-architecture CPU flags that make a dtype's matmuls native (Linux /proc/cpuinfo names; macOS sysctl FEAT_*)
X86_BF16, X86_FP16 = ("avx512_bf16", "amx_bf16"), ("avx512_fp16", "amx_fp16")
ARM_BF16, ARM_FP16 = ("bf16", "FEAT_BF16"), ("asimdhp", "FEAT_FP16")
# CUDA compute capabilities below Volta with full-rate fp16 (Tegra X1, P100, Jetson TX2); the rest of Pascal and
# Maxwell run fp16 at 1/64 or less of the float32 rate
CUDA_FAST_FP16_BEFORE_VOLTA = ((5, 3), (6, 0), (6, 2))
# oneDNN's x86 ISA levels, oldest first (its `ONEDNN_MAX_CPU_ISA` names, with their AVX10 aliases): a cap below
# AVX512_CORE_BF16 makes oneDNN, and with it torch's bf16 matmuls, emulate bf16 on any CPU; below AVX512_CORE_FP16,
# fp16. Names it does not list here (DEFAULT, ALL, newer ISAs) cap nothing that matters for these two.
ONEDNN_X86_ISAS = (
    ("SSE41",),
    ("AVX",),
    ("AVX2",),
    ("AVX2_VNNI",),
    ("AVX2_VNNI_2",),
    ("AVX512_CORE",),
    ("AVX512_CORE_VNNI",),
    ("AVX512_CORE_BF16",),
    ("AVX512_CORE_FP16", "AVX10_1_512"),
    ("AVX512_CORE_AMX", "AVX10_1_512_AMX"),
    ("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16"),
)
SLOWDOWN = "26x slower than float32 for a forward+backward of SmolLM2-135M, measured on an AVX2-only AMD EPYC"


@dataclass(frozen=True)
class NativePrecision:
    """Whether bf16 and fp16 arithmetic runs natively (in hardware) on a device, and why, in words."""

    bf16: bool
    fp16: bool
    why: str

    def native(self, dtype: torch.dtype) -> bool:
        return {torch.bfloat16: self.bf16, torch.float16: self.fp16}.get(dtype, True)


def native_precision(
    device_type: str,
    machine: str = "",
    cpu_flags: frozenset[str] | set[str] = frozenset(),
    cuda_capability: tuple[int, int] | None = None,
    cuda_bf16: bool | None = None,
    onednn: bool = True,
    onednn_max_isa: str | None = None,
) -> NativePrecision:
    """Pure: which low precisions are native on ``device_type`` ('cpu', 'cuda', ...).

    CPU: ``machine`` is ``platform.machine()``, ``cpu_flags`` the CPU's feature flags. x86 computes bf16 natively
    with AVX512-BF16 or AMX-BF16 and fp16 with AVX512-FP16 or AMX-FP16 (AVX2's F16C only converts); ARM with its
    BF16 and FP16 (``asimdhp``) extensions, where torch reaches them through oneDNN (``onednn``: its macOS wheels
    do not, and fall back to generic kernels). Any other CPU architecture is assumed not native. On x86,
    ``onednn_max_isa`` is oneDNN's dispatch cap (the ``ONEDNN_MAX_CPU_ISA`` environment variable): a cap below
    AVX512_CORE_BF16 (AVX512_CORE_FP16) makes bf16 (fp16) emulated whatever the flags say.
    CUDA: ``cuda_bf16`` is ``torch.cuda.is_bf16_supported(including_emulation=False)`` where known (it also covers
    ROCm), else Ampere (8.0) or newer; fp16 is native from Volta (7.0), and on 5.3, 6.0 and 6.2.
    Other accelerators (MPS, XPU, ...) are not second-guessed: their runtime refuses what it cannot do."""
    machine = machine.lower()
    said = lambda on, names: f"{'with' if on else 'without'} {' or '.join(names)}"  # noqa: E731
    if device_type == "cpu":
        if machine in X86:
            kind, bf16_flags, fp16_flags = "x86 CPU", ("AVX512-BF16", "AMX-BF16"), ("AVX512-FP16", "AMX-FP16")
            bf16, fp16 = any(f in cpu_flags for f in X86_BF16), any(f in cpu_flags for f in X86_FP16)
            level = onednn_isa_level(onednn_max_isa)
            needs = (("bf16", bf16, "AVX512_CORE_BF16"), ("fp16", fp16, "AVX512_CORE_FP16"))
            capped = [name for name, on, need in needs if on and level is not None and level < onednn_isa_level(need)]
            if capped:
                why = (
                    f"{kind} {said(bf16, bf16_flags)}, {said(fp16, fp16_flags)}, but oneDNN is capped at "
                    f"{onednn_max_isa.strip().upper()} (ONEDNN_MAX_CPU_ISA), which emulates {' and '.join(capped)}"
                )
                return NativePrecision(bf16 and "bf16" not in capped, fp16 and "fp16" not in capped, why)
        elif machine in ARM:
            kind, bf16_flags, fp16_flags = "ARM CPU", ("BF16",), ("FP16",)
            bf16, fp16 = any(f in cpu_flags for f in ARM_BF16), any(f in cpu_flags for f in ARM_FP16)
            if not onednn and (bf16 or fp16):
                why = f"ARM CPU {said(bf16, bf16_flags)}, but torch without oneDNN computes it in generic kernels"
                return NativePrecision(False, False, why)
        else:
            return NativePrecision(False, False, f"CPU architecture {machine or 'unknown'!r}: assumed not native")
        return NativePrecision(bf16, fp16, f"{kind} {said(bf16, bf16_flags)}, {said(fp16, fp16_flags)}")
    if device_type == "cuda":
        major, minor = cuda_capability or (0, 0)
        bf16 = cuda_bf16 if cuda_bf16 is not None else major >= 8
        fp16 = cuda_capability is None or major >= 7 or (major, minor) in CUDA_FAST_FP16_BEFORE_VOLTA
        gpu = f"CUDA device of compute capability {major}.{minor}" if cuda_capability else "CUDA device"
        return NativePrecision(bf16, fp16, f"{gpu} {said(bf16, ('native bf16',))}, {said(fp16, ('fast fp16',))}")
    return NativePrecision(True, True, f"{device_type} device: left to its runtime")


def onednn_isa_level(name: str | None) -> int | None:
    """Pure: the rank of a oneDNN x86 ISA name in ``ONEDNN_X86_ISAS`` (case-insensitive), or None for no name or one
    that caps nothing listed there (DEFAULT, ALL, ISAs newer than the list)."""
    name = (name or "").strip().upper()
    return next((level for level, names in enumerate(ONEDNN_X86_ISAS) if name in names), None)


def cpuinfo_field(cpuinfo: str, keys: tuple[str, ...]) -> str | None:
    """Pure: the first processor's value of the first of ``keys`` in a Linux ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys and value.strip():
            return value.strip()
    return None


def cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """Pure: the feature flags of the first processor in a Linux ``/proc/cpuinfo`` text (x86 'flags', ARM
    'Features')."""
    return frozenset((cpuinfo_field(cpuinfo, ("flags", "Features")) or "").split())


def _read_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: /proc/cpuinfo on Linux, sysctl on macOS, plus torch's own x86 checks (what
    oneDNN dispatches on), which also answer where neither is available (Windows)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo_flags(cpuinfo.read_text(errors="replace"))) if cpuinfo.exists() else set()
    if platform.system() == "Darwin":
        import subprocess

        for feature in ("FEAT_BF16", "FEAT_FP16"):
            try:
                out = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{feature}"], capture_output=True, text=True)
            except OSError:
                break
            if out.stdout.strip() == "1":
                flags.add(feature)
    checks = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_fp16": "_is_amx_fp16_supported"}
    flags.update(flag for flag, check in checks.items() if getattr(torch.cpu, check, lambda: False)())
    return frozenset(flags)


@functools.cache
def device_precision(device: str | torch.device = "cpu") -> NativePrecision:
    """``native_precision`` for a device of this machine ('cpu', 'cuda', 'cuda:1', ...)."""
    device = torch.device(device)
    if device.type == "cpu":
        onednn = torch.backends.mkldnn.is_available()
        # oneDNN reads ONEDNN_MAX_CPU_ISA, or its older name, once, when it first dispatches; this answer is cached
        # too, so both follow the environment the process had when it first asked
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return native_precision("cpu", platform.machine(), _read_cpu_flags(), onednn=onednn, onednn_max_isa=cap)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return native_precision("cuda", cuda_capability=torch.cuda.get_device_capability(index), cuda_bf16=bf16)
    return native_precision(device.type)


def cpu_name() -> str:
    """The CPU's model name (for benchmark tables and summaries), or the architecture where none is reported."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    name = cpuinfo_field(text, ("model name", "Model name", "Hardware"))
    return name or platform.processor() or platform.machine() or "unknown CPU"


def recipe_precision(device: str | torch.device = "cpu") -> tuple[bool | None, str]:
    """The recipes' and benchmarks' default for ``bf16``, and a sentence saying which and why: ``None`` (TRL's own
    default, which turns bf16 autocast on unless ``fp16`` is given) where the training device computes bf16
    natively, ``False`` (float32) where it would be emulated."""
    native = device_precision(device)
    if native.bf16:
        return None, f"bf16 autocast over float32 weights, chosen: native here ({native.why})"
    return False, f"float32, chosen: bf16 would be emulated here ({native.why}; {SLOWDOWN})"


def described_precision(bf16: bool, fp16: bool, device: str | torch.device = "cpu") -> str:
    """What a run computes in and why, for progress output and summaries: the recipes' choice, or the user's."""
    default, chosen = recipe_precision(device)
    if bf16 == (default is None) and not fp16:
        return chosen
    native = device_precision(device)
    if fp16 and torch.device(device).type == "cpu":
        return f"float32: fp16=True has no effect on a CPU (accelerate autocasts only bf16 there) ({native.why})"
    name = "bf16 autocast" if bf16 else "fp16 autocast" if fp16 else "float32"
    emulated = (bf16 and not native.bf16) or (fp16 and not native.fp16)
    return f"{name}, as given ({native.why}{'; emulated here, far slower than float32' if emulated else ''})"


def emulated_precision_warning(bf16: bool, fp16: bool, device: str | torch.device) -> str | None:
    """The trainer's warning when ``bf16``/``fp16`` is on for a device that emulates it, else None. On a CPU,
    fp16 does nothing (accelerate autocasts only bf16 there): the trainer computes in float32, and is told so."""
    native, cpu = device_precision(device), torch.device(device).type == "cpu"
    if fp16 and cpu:
        return (
            "fp16=True has no effect on a CPU: accelerate autocasts only bf16 there, so the trainer computes in "
            f"float32 ({native.why}). Set fp16=False to say so, or bf16=True where the CPU computes bf16 natively."
        )
    slow = [name for name, on, ok in (("bf16", bf16, native.bf16), ("fp16", fp16, native.fp16)) if on and not ok]
    if not slow:
        return None
    setting = " and ".join(f"{name}=True" for name in slow)
    fix = " and ".join(f"{name}=False" for name in slow)
    where = "this CPU" if cpu else f"device {device}"
    return (
        f"{setting}, but {where} computes {' and '.join(slow)} in emulation ({native.why}). Expect training far "
        f"slower than in float32 ({SLOWDOWN}). Set {fix} (`--{slow[0]} false`) to train in float32. The setting is "
        "kept as given, as GRPOTrainer keeps it."
    )
