"""The sandbox's rules, without running anything: limits, file names, levels, and how a run's end is read."""

import signal

import pytest

from trl_async.sandbox import Limits, SandboxResult
from trl_async.sandbox import isolation as iso
from trl_async.sandbox.limits import limits_hit
from trl_async.sandbox.runner import _check_files


def hit(**kwargs):
    base = dict(timed_out=False, output_exceeded=False, signal_number=None, stderr="")
    return limits_hit(**{**base, **kwargs})


def test_a_clean_exit_hits_nothing():
    assert hit() == ()
    assert hit(stderr="ValueError: bad input") == ()


def test_each_limit_is_named_from_what_the_run_showed():
    assert hit(timed_out=True) == ("wall_time",)
    assert hit(output_exceeded=True, signal_number=signal.SIGPIPE) == ("output",)
    assert hit(signal_number=signal.SIGXCPU) == ("cpu_time",)
    assert hit(signal_number=signal.SIGKILL, cpu_s=3.0, cpu_limit_s=2) == ("cpu_time",)  # the hard limit, 1 s later
    assert hit(signal_number=signal.SIGKILL, cpu_s=0.1, cpu_limit_s=2) == ()  # killed otherwise (OOM, itself)
    assert hit(signal_number=signal.SIGKILL, timed_out=True) == ("wall_time",)  # killed by the wall clock instead
    assert hit(signal_number=signal.SIGXFSZ) == ("file_size",)
    assert hit(stderr="Traceback ...\nMemoryError\n") == ("memory",)
    assert hit(stderr="BlockingIOError: [Errno 11] Resource temporarily unavailable") == ("processes",)
    assert hit(stderr="OSError: [Errno 27] File too large") == ("file_size",)
    assert hit(stderr="OSError: [Errno 28] No space left on device") == ("disk",)


def test_several_limits_are_all_named_once():
    assert hit(timed_out=True, stderr="BlockingIOError\nBlockingIOError") == ("wall_time", "processes")
    assert hit(signal_number=signal.SIGXFSZ, stderr="File too large") == ("file_size",)


def test_limits_refuse_non_positive_values_by_name():
    with pytest.raises(ValueError, match="Limits.memory_mib"):
        Limits(memory_mib=0)
    with pytest.raises(ValueError, match="Limits.wall_s"):
        Limits(wall_s=-1)
    assert Limits(memory_mib=2, cpu_s=3).rlimits() == {
        "cpu_s": 3,
        "memory_bytes": 2 << 20,
        "processes": 32,
        "file_bytes": 16 << 20,
        "open_files": 256,
    }


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../b", "", "a//b"])
def test_file_names_stay_inside_the_working_directory(name):
    with pytest.raises(ValueError, match="relative path"):
        _check_files({name: ""})
    _check_files({"main.py": "", "pkg/mod.py": ""})


def test_result_summary_and_flags():
    done = dict(stdout="", stderr="", seconds=0.1, isolation="namespaces")
    assert SandboxResult(exit_code=0, signal=None, limits=(), **done).ok
    slow = SandboxResult(exit_code=None, signal=None, limits=("wall_time", "processes"), **done)
    assert not slow.ok and slow.timed_out and slow.summary() == "stopped: wall-clock limit, process limit"
    assert SandboxResult(exit_code=None, signal=9, limits=(), **done).summary() == "killed by signal SIGKILL"
    assert SandboxResult(exit_code=3, signal=None, limits=(), **done).summary() == "exit status 3"


def test_a_level_the_machine_lacks_is_refused_or_degraded_with_what_is_lost(monkeypatch):
    monkeypatch.setattr(iso, "namespaces_refusal", lambda: "the kernel refused new namespaces (EPERM)")
    with pytest.raises(iso.SandboxUnavailable, match="isolation='rlimits'.*network"):
        iso.resolve("namespaces")
    with pytest.warns(RuntimeWarning, match="rlimits only.*EPERM.*network"):
        assert iso.resolve("auto") == "rlimits"
    assert iso.resolve("rlimits") == "rlimits"
    with pytest.raises(ValueError, match="isolation must be one of"):
        iso.resolve("docker")


def test_the_trainers_packages_are_hidden_wherever_they_are_visible(monkeypatch):
    monkeypatch.setattr(iso.site, "getsitepackages", lambda: ["/usr/lib/python3/dist-packages", "/opt/venv/lib"])
    monkeypatch.setattr(iso.sys, "base_prefix", "/usr")
    hidden = iso.hidden_dirs()
    assert "/usr/lib/python3/dist-packages" in hidden  # under /usr, which programs see
    assert "/opt/venv/lib" not in hidden  # never made visible in the first place
