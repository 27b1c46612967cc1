"""Which low precisions a device computes natively (trl_async.hardware.precision), on the flag sets of real CPUs and GPUs,
and the trainer's construction warning when bf16/fp16 is asked for where it is emulated."""

import os
import platform
import warnings

import pytest
import torch

from trl_async import AsyncGRPOTrainer
from trl_async.hardware.precision import (
    NativePrecision,
    cpuinfo_flags,
    described_precision,
    device_precision,
    emulated_precision_warning,
    native_precision,
    recipe_precision,
)

from ..conftest import async_args, letter_reward, text_dataset

# feature flags as /proc/cpuinfo lists them (abridged to what matters plus neighbours that must not count)
AMD_EPYC_AVX2 = {"sse4_2", "avx", "avx2", "f16c", "fma", "sha_ni", "vaes"}  # Zen 3, AVX2 only
AMD_ZEN4 = AMD_EPYC_AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16"}  # bf16 yes, AVX512-FP16 no
XEON_ICELAKE = AMD_EPYC_AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}  # AVX-512 without its bf16 extension
XEON_SAPPHIRE_RAPIDS = XEON_ICELAKE | {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}
GRAVITON2 = {"fp", "asimd", "fphp", "asimdhp", "asimddp", "atomics"}  # Neoverse N1: fp16 yes, bf16 no
GRAVITON3 = GRAVITON2 | {"sve", "svebf16", "bf16", "i8mm"}
APPLE_M1, APPLE_M2 = {"FEAT_FP16"}, {"FEAT_FP16", "FEAT_BF16"}  # macOS sysctl hw.optional.arm.*


@pytest.mark.unit
@pytest.mark.parametrize(
    "machine, flags, bf16, fp16",
    [
        ("x86_64", AMD_EPYC_AVX2, False, False),
        ("x86_64", AMD_ZEN4, True, False),
        ("x86_64", XEON_ICELAKE, False, False),  # AVX-512 alone is not bf16
        ("x86_64", XEON_SAPPHIRE_RAPIDS, True, True),
        ("x86_64", {"amx_bf16"}, True, False),  # either extension suffices
        ("AMD64", {"avx512_bf16"}, True, False),  # Windows spells the architecture so
        ("aarch64", GRAVITON2, False, True),
        ("aarch64", GRAVITON3, True, True),
        ("arm64", APPLE_M1, False, True),
        ("arm64", APPLE_M2, True, True),
        ("x86_64", GRAVITON3, False, False),  # ARM's flag names mean nothing on x86 ...
        ("aarch64", XEON_SAPPHIRE_RAPIDS, False, False),  # ... and x86's nothing on ARM
        ("riscv64", {"bf16", "avx512_bf16"}, False, False),  # an architecture it does not know: not native
    ],
)
def test_cpu_precision_follows_the_architectures_own_flags(machine, flags, bf16, fp16):
    native = native_precision("cpu", machine, frozenset(flags))
    assert (native.bf16, native.fp16) == (bf16, fp16)
    if machine != "riscv64":  # the reason says which, e.g. "x86 CPU without AVX512-BF16 or AMX-BF16, ..."
        assert native.why.split()[2] == ("with" if bf16 else "without")


@pytest.mark.unit
@pytest.mark.parametrize(
    "capability, cuda_bf16, bf16, fp16",
    [
        ((8, 0), None, True, True),  # A100
        ((9, 0), True, True, True),  # H100, torch says so too
        ((7, 0), None, False, True),  # V100: fp16 tensor cores, bf16 only emulated
        ((7, 5), False, False, True),  # T4
        ((6, 1), None, False, False),  # P40 / GTX 10xx: fp16 at 1/64 rate
        ((6, 0), None, False, True),  # P100
        ((9, 4), True, True, True),  # ROCm MI300 as torch reports it: torch's bf16 answer wins
    ],
)
def test_cuda_precision_follows_torch_and_the_compute_capability(capability, cuda_bf16, bf16, fp16):
    native = native_precision("cuda", cuda_capability=capability, cuda_bf16=cuda_bf16)
    assert (native.bf16, native.fp16) == (bf16, fp16)


@pytest.mark.unit
def test_arm_bf16_counts_only_where_torch_reaches_it_through_onednn():
    # torch's macOS arm64 wheels have no oneDNN: an M2's BF16 instructions go unused by its CPU matmuls
    native = native_precision("cpu", "arm64", frozenset(APPLE_M2), onednn=False)
    assert (native.bf16, native.fp16) == (False, False) and "without oneDNN" in native.why
    assert native_precision("cpu", "x86_64", frozenset(XEON_SAPPHIRE_RAPIDS), onednn=False).bf16  # x86: flags decide


@pytest.mark.unit
def test_other_accelerators_are_left_to_their_runtime_and_dtypes_answer_by_name():
    assert native_precision("mps") == NativePrecision(True, True, "mps device: left to its runtime")
    native = NativePrecision(bf16=False, fp16=True, why="")
    assert [native.native(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [False, True, True]


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx f16c avx2 sha_ni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx f16c avx2 sha_ni avx512_bf16
"""
GRAVITON_CPUINFO = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd asimdhp bf16 sve\nCPU part\t: 0xd40\n"


@pytest.mark.unit
def test_cpuinfo_flags_are_the_first_processors_x86_flags_or_arm_features():
    assert cpuinfo_flags(CPUINFO) == {"fpu", "sse2", "avx", "f16c", "avx2", "sha_ni"}
    assert cpuinfo_flags(GRAVITON_CPUINFO) == {"fp", "asimd", "asimdhp", "bf16", "sve"}
    assert cpuinfo_flags("processor\t: 0\n") == frozenset()


@pytest.mark.unit
def test_this_machines_cpuinfo_agrees_with_torchs_own_check(monkeypatch):
    # two independent readings of the same CPU: /proc/cpuinfo's flags and torch's cpuid-based check (oneDNN's)
    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("torch's AVX512-BF16 check is x86's, /proc/cpuinfo Linux's")
    flags = cpuinfo_flags(open("/proc/cpuinfo").read())
    assert native_precision("cpu", platform.machine(), flags).bf16 == torch.cpu._is_avx512_bf16_supported()
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # uncapped: the CPU's own answer
        monkeypatch.delenv(name, raising=False)
    device_precision.cache_clear()
    try:
        native = device_precision("cpu").bf16
        assert native == torch.cpu._is_avx512_bf16_supported()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # capped: emulated on every CPU, whatever its flags
        device_precision.cache_clear()
        assert not device_precision("cpu").bf16
        assert ("capped at AVX2" in device_precision("cpu").why) == native  # the cap is named where it decides
    finally:
        device_precision.cache_clear()


@pytest.mark.unit
@pytest.mark.parametrize(
    "cap, bf16, fp16",
    [
        (None, True, True),
        ("AVX2", False, False),  # what an AVX2-only CPU computes: both emulated
        ("avx512_core", False, False),  # AVX-512 without its bf16 level; the name is read case-blind
        ("AVX512_CORE_BF16", True, False),  # the bf16 level, below fp16's
        ("AVX10_1_512", True, True),  # AVX512_CORE_FP16's other name
        ("AVX512_CORE_AMX", True, True),
        ("DEFAULT", True, True),  # no cap
        ("AVX10_2_512", True, True),  # a level newer than the list caps nothing listed
    ],
)
def test_a_onednn_isa_cap_below_a_dtypes_level_makes_it_emulated(cap, bf16, fp16):
    # Measured on an AMD EPYC with AVX512-BF16 (one thread, a 1760 x 576 by 576 x 1536 linear): bf16 12.3 ms,
    # with ONEDNN_MAX_CPU_ISA=AVX2 155.9 ms, while float32 stayed at 38-53 ms
    native = native_precision("cpu", "x86_64", frozenset(XEON_SAPPHIRE_RAPIDS), onednn_max_isa=cap)
    assert (native.bf16, native.fp16) == (bf16, fp16)
    assert ("capped at" in native.why) == ((bf16, fp16) != (True, True))
    # a cap never makes a CPU native, and it is x86's: ARM ignores it
    assert not native_precision("cpu", "x86_64", frozenset(AMD_EPYC_AVX2), onednn_max_isa=cap).bf16
    assert native_precision("cpu", "aarch64", frozenset(GRAVITON3), onednn_max_isa=cap).bf16


@pytest.mark.unit
def test_recipes_choose_bf16_only_where_it_is_native_and_say_so(monkeypatch):
    monkeypatch.setattr(
        "trl_async.hardware.precision.device_precision", lambda device: NativePrecision(False, False, "no")
    )
    bf16, said = recipe_precision()
    assert bf16 is False and said.startswith("float32, chosen: bf16 would be emulated here (no; 26x slower")
    assert described_precision(False, False) == said
    assert described_precision(True, False) == "bf16 autocast, as given (no; emulated here, far slower than float32)"
    assert described_precision(False, True).startswith("float32: fp16=True has no effect on a CPU")
    monkeypatch.setattr(
        "trl_async.hardware.precision.device_precision", lambda device: NativePrecision(True, False, "yes")
    )
    # None: TRL's own default (bf16 unless fp16 is given), so `--fp16 true` still parses
    assert recipe_precision() == (None, "bf16 autocast over float32 weights, chosen: native here (yes)")
    assert described_precision(True, False) == "bf16 autocast over float32 weights, chosen: native here (yes)"
    assert described_precision(False, False) == "float32, as given (yes)"
    assert described_precision(False, True, "cuda") == (
        "fp16 autocast, as given (yes; emulated here, far slower than float32)"
    )


@pytest.mark.unit
def test_the_warning_names_the_setting_the_slowdown_and_the_fix(monkeypatch):
    monkeypatch.setattr(
        "trl_async.hardware.precision.device_precision", lambda d: NativePrecision(False, True, "AVX2 only")
    )
    message = emulated_precision_warning(True, False, "cpu")
    assert message.startswith("bf16=True, but this CPU computes bf16 in emulation (AVX2 only)")
    assert "26x slower than float32" in message and "Set bf16=False (`--bf16 false`)" in message
    assert emulated_precision_warning(False, False, "cpu") is None
    # fp16 on a CPU is not emulated but ignored (accelerate autocasts only bf16 there): say that instead
    assert emulated_precision_warning(False, True, "cpu").startswith("fp16=True has no effect on a CPU")
    assert emulated_precision_warning(False, True, "cuda") is None  # fp16 native on this (patched) device
    monkeypatch.setattr("trl_async.hardware.precision.device_precision", lambda d: NativePrecision(True, False, "T4"))
    assert emulated_precision_warning(False, True, "cuda").startswith("fp16=True, but device cuda computes fp16")


def construction_warnings(tmp_path, model, **overrides) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=async_args(tmp_path, **overrides),
                                   train_dataset=text_dataset())  # fmt: skip
    return trainer, [str(w.message) for w in caught if "in emulation" in str(w.message)]


def test_the_trainer_warns_once_at_construction_and_keeps_the_users_setting(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(
        "trl_async.hardware.precision.device_precision", lambda d: NativePrecision(False, False, "AVX2 only")
    )
    trainer, said = construction_warnings(tmp_path, tiny_model_dir, bf16=True)
    assert len(said) == 1 and said[0].startswith("bf16=True, but this CPU computes bf16 in emulation (AVX2 only)")
    assert trainer.args.bf16 is True  # drop-in: GRPOTrainer's semantics, the setting is not changed
    assert construction_warnings(tmp_path, tiny_model_dir, bf16=False)[1] == []
    monkeypatch.setattr("trl_async.hardware.precision.device_precision", lambda d: NativePrecision(True, True, "AMX"))
    assert construction_warnings(tmp_path, tiny_model_dir, bf16=True)[1] == []  # native: nothing to say
