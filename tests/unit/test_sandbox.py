"""The sandbox's rules, without running anything: limits, file names, levels, and how a run's end is read."""

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trl_async.sandbox import Limits, SandboxError, SandboxResult
from trl_async.sandbox import isolation as iso
from trl_async.sandbox.arguments import (
    check_argv,
    check_files,
    check_limits,
    check_stdin,
)
from trl_async.sandbox.limits import limits_hit, signal_name
from trl_async.sandbox.runner import open_lock_folder


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


@pytest.mark.parametrize(
    "field, value, says",
    [("memory_mib", 0, "above 0"), ("wall_s", -1, "above 0"), ("wall_s", float("nan"), "finite"),
     ("wall_s", float("inf"), "finite"), ("cpu_s", float("inf"), "finite"), ("output_bytes", 1e4, "pass 10000"),
     ("disk_mib", float("nan"), "whole number"), ("memory_mib", 1e15, "whole number"),
     ("memory_mib", 10**15, "at most"), ("processes", True, "whole number"), ("open_files", "8", "whole number"),
     ("wall_s", 10**6, "at most")],
)  # fmt: skip
def test_limits_refuse_what_is_not_a_finite_positive_number_of_the_right_kind(field, value, says):
    with pytest.raises(ValueError, match=f"Limits.{field} .*{says}"):
        Limits(**{field: value})


def test_limits_set_whole_rlimits():
    assert Limits(memory_mib=2, cpu_s=3).rlimits() == {
        "cpu_s": 4,
        "memory_bytes": 2 << 20,
        "processes": 32,
        "file_bytes": 16 << 20,
        "open_files": 256,
    }
    assert Limits(cpu_s=2.5).rlimits()["cpu_s"] == 4  # a backstop past the run's budget, which the launcher enforces


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../b", "", "a//b"])
def test_file_names_stay_inside_the_working_directory(name):
    with pytest.raises(ValueError, match="relative path"):
        check_files({name: ""})
    check_files({"main.py": "", "pkg/mod.py": ""})


def test_result_summary_and_flags():
    done = dict(stdout="", stderr="", seconds=0.1, isolation="namespaces")
    assert SandboxResult(exit_code=0, signal=None, limits=(), **done).ok
    slow = SandboxResult(exit_code=None, signal=None, limits=("wall_time", "processes"), **done)
    assert not slow.ok and slow.timed_out and slow.summary() == "stopped: wall-clock limit, process limit"
    assert SandboxResult(exit_code=None, signal=9, limits=(), **done).summary() == "killed by SIGKILL"
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


def test_signal_names_cover_every_signal_a_process_can_receive():
    assert signal_name(9) == "SIGKILL" and signal_name(signal.SIGRTMIN + 6) == "SIGRTMIN+6"
    assert signal_name(999) == "signal 999" and signal_name(-1) == "signal -1"
    for number in range(1, 65):  # 32 and 33 belong to the C library's threads, and still have a name here
        SandboxResult(
            exit_code=None, signal=number, stdout="", stderr="", limits=(), seconds=0, isolation="x"
        ).summary()


@given(
    exit_code=st.one_of(st.none(), st.integers()),
    number=st.one_of(st.none(), st.integers()),
    stdout=st.text(),
    stderr=st.text(),
    limits=st.lists(st.sampled_from(["wall_time", "cpu_time", "output", "memory", "bogus"])),
)
def test_any_result_summarises_without_raising(exit_code, number, stdout, stderr, limits):
    result = SandboxResult(exit_code=exit_code, signal=number, stdout=stdout, stderr=stderr, limits=tuple(limits),
                           seconds=0.0, isolation="namespaces")  # fmt: skip
    assert isinstance(result.summary(), str)


@pytest.mark.parametrize(
    "call, says",
    [(lambda: check_argv("/bin/echo hi"), r"not one string: pass \['/bin/echo', 'hi'\]"),
     (lambda: check_argv([]), "non-empty list"), (lambda: check_argv(["/bin/echo", 3]), "every argv item"),
     (lambda: check_argv(["echo"]), "absolute path"), (lambda: check_argv(["/bin/ec\x00ho"]), "NUL"),
     (lambda: check_stdin(3), "stdin must be str or bytes"), (lambda: check_stdin("\udc80"), "pass bytes"),
     (lambda: check_files({5: "x"}), "must be a string"), (lambda: check_files({"a": 5}), r"files\['a'\]"),
     (lambda: check_files(["a"]), "mapping"), (lambda: check_limits({"wall_s": 1}, Limits()), "Limits\\(\\*\\*"),
     (lambda: check_limits(Limits(open_files=1 << 20), Limits()), "open_files")],
)  # fmt: skip
def test_a_callers_mistake_is_a_value_error_naming_the_argument(call, says, monkeypatch):
    monkeypatch.setattr("builtins.open", _nr_open(1024), raising=True)
    with pytest.raises(ValueError, match=says):
        call()


def _nr_open(value: int):
    """``open`` that reads ``value`` from ``/proc/sys/fs/nr_open`` (so the file limit refuses a million)."""
    import builtins
    import io

    real = builtins.open

    def fake(path, *args, **kwargs):
        return io.StringIO(str(value)) if path == "/proc/sys/fs/nr_open" else real(path, *args, **kwargs)

    return fake


def test_stdin_has_one_meaning_per_type():
    assert check_stdin(None) == b"" and check_stdin("é") == "é".encode() and check_stdin(b"\xff") == b"\xff"


def test_the_uid_lock_folder_is_refused_unless_it_is_this_users_alone(tmp_path):
    import os

    good = tmp_path / "locks"
    os.close(open_lock_folder(str(good)))  # made with mode 0700
    assert good.stat().st_mode & 0o777 == 0o700
    os.chmod(good, 0o777)
    with pytest.raises(SandboxError, match="mode 0o777"):
        open_lock_folder(str(good))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(SandboxError, match="not a folder"):
        open_lock_folder(str(link))
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_launcher_that_never_reports_is_a_failed_run_only_where_the_program_could_kill_it():
    """Where the program runs as the trainer's user (rlimits, non-root), it can kill its launcher: the run then ends
    as a failed run, not as a ``SandboxError`` through the reward. Anywhere else a lost launcher is the sandbox's
    failure; past the backstop, a run that timed out; a report that arrived counts even then."""
    import marshal

    from trl_async.sandbox.runner import _report

    assert _report(b"", False, lost_is_the_programs=True)["lost"]
    assert _report(b"\x00garbage", False, lost_is_the_programs=True)["exit"] is None
    with pytest.raises(SandboxError, match="without a report"):
        _report(b"", False, lost_is_the_programs=False)
    assert _report(b"", True, lost_is_the_programs=False)["timed_out"]
    done = {"timed_out": False, "exit": 0, "signal": None}
    assert _report(marshal.dumps(done), True, lost_is_the_programs=False) == done
    with pytest.raises(SandboxError, match="could not be set up"):
        _report(marshal.dumps({"setup_error": "OSError: x"}), False, lost_is_the_programs=False)


def test_a_machine_without_libseccomp_is_warned_about(monkeypatch):
    monkeypatch.setattr(iso, "seccomp_missing", lambda: "libseccomp is not installed, so ...")
    from trl_async.sandbox import runner

    monkeypatch.setattr(runner, "seccomp_missing", iso.seccomp_missing)
    with pytest.warns(RuntimeWarning, match="libseccomp is not installed"):
        runner.Sandbox(isolation="rlimits")
