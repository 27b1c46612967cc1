"""Hostile programs in the sandbox: each is contained, the result says why, nothing is left running, the planted
secret never shows, and no file outside the sandbox changes."""

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trl_async.sandbox import Limits, Sandbox
from trl_async.sandbox.runner import MAX_CONCURRENCY, UID_BASE

PROJECT = Path(__file__).resolve().parents[2]
SECRET_NAME = "TRL_ASYNC_PLANTED_SECRET"
LIMITS = Limits(wall_s=4, cpu_s=2, memory_mib=256, processes=16, output_bytes=4096, file_mib=4, disk_mib=16)


def sandbox_processes() -> list[str]:
    """Every process on the machine owned by a sandbox uid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
        except FileNotFoundError:
            continue
        if UID_BASE <= uid < UID_BASE + MAX_CONCURRENCY * (1 << 16):
            found.append(entry)  # zombies included: the launcher reaps everything it killed before it reports
    return found


def processes_named(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(entry)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def plant_key(secret: str) -> None:
    """The secret also as a key in this process's session keyring (where credentials such as Kerberos tickets
    live), when the kernel lets this process add one."""
    import ctypes

    if os.uname().machine == "x86_64":  # add_key(2)
        ctypes.CDLL(None).syscall(248, b"user", b"trl_async_planted", secret.encode(), len(secret), ctypes.c_int(-3))


def snapshot(folder: Path) -> dict:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def vsock_listener():
    """A vsock port the trainer holds (the host-hypervisor channel, which no network namespace covers), where the
    kernel offers vsock."""
    try:
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        sock.bind((socket.VMADDR_CID_ANY, 40_000 + uuid.uuid4().int % 20_000))
        sock.listen(1)
        sock.settimeout(0.2)
        return sock
    except (AttributeError, OSError):
        return None


@pytest.fixture
def world(tmp_path, monkeypatch):
    """What a program might attack: a secret in the trainer's environment, a folder of the trainer's files, a
    listener on loopback and a process of the trainer's."""
    secret = "planted-" + uuid.uuid4().hex
    monkeypatch.setenv(SECRET_NAME, secret)
    guarded = tmp_path / "trainer_files"
    guarded.mkdir()
    (guarded / "precious.txt").write_text("keep me")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    victim = subprocess.Popen(["sleep", "600"])
    plant_key(secret)
    vsock = vsock_listener()
    world = dict(
        secret=secret,
        guarded=guarded,
        port=listener.getsockname()[1],
        victim=victim.pid,
        marker=f"4242.{uuid.uuid4().int % 10**6}",
        before=snapshot(guarded),
        listener=listener,
        vsock_port=vsock.getsockname()[1] if vsock else 4242,
        vsock=vsock,
    )
    yield world
    if vsock:
        vsock.close()
    victim.kill()
    victim.wait()
    listener.close()


CASES = {
    "loops_forever": "while True:\n    pass\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "allocates_until_killed": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n",
    "fills_the_disk": (
        "import itertools\n"
        "for i in itertools.count():\n"
        "    with open(f'fill{{i}}', 'wb') as f:\n"
        "        f.write(b'0' * (2 << 20))\n"
    ),
    "writes_outside": (
        "import os\n"
        "done = []\n"
        "for path in ['{guarded}/precious.txt', '{guarded}/new.txt', '/etc/passwd', '/usr/pwned', '/pwned',\n"
        "             '{project}/pwned.txt', '/root/pwned', '/dev/shm/../pwned']:\n"
        "    try:\n"
        "        with open(path, 'a') as f:\n"
        "            f.write('pwned')\n"
        "        done.append(path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
        "print('WROTE', done)\n"
    ),
    "reads_environment": (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        "for path in ['/proc/self/environ', '/proc/1/environ', '/proc/{trainer}/environ'] + glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
    ),
    "connects_to_loopback": (
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'hello')\n"
        "print('CONNECTED')\n"
    ),
    "signals_its_parent": (
        "import os, signal\n"
        "for sig in [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGKILL]:\n"
        "    for pid in [os.getppid(), 1, {trainer}, {victim}]:\n"
        "        try:\n"
        "            os.kill(pid, sig)\n"
        "            print('SIGNALLED', pid)\n"
        "        except OSError as exc:\n"
        "            print('refused', pid, type(exc).__name__)\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except OSError as exc:\n"
        "    print('refused -1', type(exc).__name__)\n"
    ),
    "floods_stdout": "while True:\n    print('x' * 1000)\n",
    "floods_stdout_and_stays": (
        "import time\ntry:\n    while True:\n        print('x' * 1000, flush=True)\nexcept BrokenPipeError:\n    pass\n"
        "time.sleep(60)\n"
    ),
    "leaves_a_sleeping_child": (
        "import os, subprocess\n"
        "subprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n"
        "print('LEFT')\n"
    ),
    "imports_the_trainer": (
        "import sys\n"
        "sys.path[:0] = ['{project}', '{site}']\n"
        "for name in ['trl_async', 'torch', 'trl']:\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print('IMPORTED', name)\n"
        "    except ImportError as exc:\n"
        "        print('refused', name, type(exc).__name__)\n"
    ),
    # beyond the eleven: memory that no address-space limit counts, and the trainer's session keyring
    "hides_memory_outside_its_limit": (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "try:\n"
        "    fd = os.memfd_create('hoard')\n"
        "    os.ftruncate(fd, 1 << 26)\n"
        "    os.write(fd, b'x' * (1 << 20))\n"
        "    print('HOARDED memfd')\n"
        "except OSError as exc:\n"
        "    print('refused memfd', type(exc).__name__)\n"
        "for name in ('shmmax', 'shmall', 'shmmni'):\n"
        "    try:\n"
        "        open('/proc/sys/kernel/' + name, 'w').write('1000000000')\n"
        "        print('RAISED', name)\n"
        "    except OSError:\n"
        "        print('refused', name)\n"
        "segment = libc.shmget(0, 1 << 26, 0o1000 | 0o600)\n"
        "print('HOARDED shm' if segment >= 0 else 'refused shm')\n"
    ),
    # beyond those: every socket family but unix and IP (vsock reaches the hypervisor; netlink, packet, bluetooth,
    # algorithm sockets the kernel), and a CPU limit hit by a child whose parent then exits 0
    "opens_other_socket_families": (
        "import errno, socket\n"
        "families = {{'vsock': 40, 'netlink': 16, 'packet': 17, 'bluetooth': 31, 'alg': 38, 'rds': 21, 'tipc': 30,\n"
        "            'unspec': 0, 'ax25': 3, 'huge': 1 << 40}}\n"
        "for name, family in families.items():\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):\n"
        "        try:\n"
        "            s = socket.socket(family, kind)\n"
        "            print('OPENED', name, kind)\n"
        "            if name == 'vsock':\n"
        "                s.connect((2, {vsock_port}))\n"
        "                print('CONNECTED vsock')\n"
        "        except (OSError, OverflowError) as exc:\n"
        "            print('refused', name, getattr(exc, 'errno', None) == errno.EACCES)\n"
        "    try:\n"
        "        socket.socketpair(family if family < 64 else 40)\n"
        "        print('OPENED pair', name)\n"
        "    except OSError as exc:\n"
        "        print('refused pair', name)\n"
        "a, b = socket.socketpair()\n"
        "s = socket.socket(socket.AF_INET6)\n"
        "print('ALLOWED unix and ip')\n"
    ),
    "makes_namespaces": (
        "import ctypes, errno, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for flag in (0x10000000, 0x20000, 0x40000000):  # a user, mount or network namespace through clone()\n"
        "    pid = libc.syscall(56, flag | 17, 0, 0, 0, 0)\n"
        "    if pid == 0:\n"
        "        libc._exit(0)\n"
        "    print('MADE' if pid > 0 else 'refused clone', hex(flag), ctypes.get_errno() == errno.EPERM)\n"
        "print('refused fsopen' if libc.syscall(430, b'tmpfs', 0) < 0 else 'MADE fsopen')\n"
        "print('clone3', libc.syscall(435, 0, 0) < 0 and ctypes.get_errno() == errno.ENOSYS)\n"
        "t = threading.Thread(target=print, args=('threads still start',))\n"
        "t.start()\n"
        "t.join()\n"
    ),
    "holds_capabilities": (
        "import ctypes, socket\n"
        "caps = {{l.split(':')[0]: int(l.split(':')[1], 16) for l in open('/proc/self/status') if l.startswith('Cap')}}\n"
        "print('CAPS', caps['CapEff'], caps['CapPrm'], caps['CapAmb'])\n"
        "try:\n"
        "    socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)\n"
        "    print('OPENED raw socket')\n"
        "except OSError:\n"
        "    print('refused raw socket')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('RENAMED host' if libc.sethostname(b'pwned', 5) == 0 else 'refused sethostname')\n"
    ),
    "child_exceeds_cpu": (
        "import subprocess\n"
        "done = subprocess.run(['/bin/sh', '-c', 'while :; do :; done'])\n"
        "print('child ended by', done.returncode)\n"
    ),
    "reads_the_keyring": (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "found = libc.syscall(250, 10, ctypes.c_int(-3), b'user', b'trl_async_planted', 0)  # KEYCTL_SEARCH\n"
        "print('FOUND KEY' if found >= 0 else 'refused keyctl', ctypes.get_errno())\n"
        "try:\n"
        "    print(open('/proc/keys').read())\n"
        "except OSError as exc:\n"
        "    print('refused /proc/keys', type(exc).__name__)\n"
    ),
}


def program(case: str, world: dict) -> str:
    import site

    return CASES[case].format(
        guarded=world["guarded"],
        project=PROJECT,
        trainer=os.getpid(),
        victim=world["victim"],
        port=world["port"],
        marker=world["marker"],
        site=site.getsitepackages()[0],
        vsock_port=world["vsock_port"],
    )


def check_contained(case: str, result, world: dict) -> None:
    """The case-specific verdict: contained, and the result says why."""
    out = result.stdout
    if case == "loops_forever":
        assert result.timed_out and "cpu_time" in result.limits
    elif case == "fork_bomb":
        assert "processes" in result.limits
    elif case == "allocates_until_killed":
        assert "memory" in result.limits and "MemoryError" in result.stderr
    elif case == "fills_the_disk":
        assert result.limits == ("disk",)
    elif case == "writes_outside":
        assert "WROTE []" in out, out
    elif case == "connects_to_loopback":
        assert "CONNECTED" not in out and result.exit_code != 0
        with pytest.raises(TimeoutError):
            world["listener"].accept()
    elif case == "signals_its_parent":
        # the trainer and its other process are out of reach; the run's own init ignores what it is sent (a
        # non-root trainer's program may "signal" it without effect) and still reports the program's exit
        assert f"SIGNALLED {os.getpid()}" not in out and f"SIGNALLED {world['victim']}" not in out and result.ok, out
        os.kill(world["victim"], 0)  # still alive
    elif case == "floods_stdout_and_stays":  # the output limit ends the run, not the wall clock
        assert result.limits == ("output",) and result.seconds < 2, (result.limits, result.seconds)
    elif case == "floods_stdout":
        assert result.limits == ("output",) and len(result.stdout) == LIMITS.output_bytes
    elif case == "leaves_a_sleeping_child":
        assert result.ok and "LEFT" in out
    elif case == "hides_memory_outside_its_limit":
        assert "HOARDED" not in out and "refused memfd PermissionError" in out and "refused shm" in out, out
        assert "RAISED" not in out, out
    elif case == "reads_the_keyring":
        assert "FOUND KEY" not in out and "trl_async_planted" not in out, out
    elif case == "opens_other_socket_families":
        assert "OPENED" not in out and "CONNECTED" not in out and "ALLOWED unix and ip" in out, out
        assert "refused vsock True" in out and "refused netlink True" in out and "refused huge" in out, out
        if world["vsock_port"] != 4242:
            with pytest.raises(TimeoutError):
                world["vsock"].accept()
    elif case == "makes_namespaces":
        assert "MADE" not in out and out.count("True") == 4 and "threads still start" in out, out
    elif case == "holds_capabilities":  # none, though run_python starts no new interpreter (no execve drops them)
        assert "CAPS 0 0 0" in out and "refused raw socket" in out and "refused sethostname" in out, out
    elif case == "child_exceeds_cpu":
        assert "cpu_time" in result.limits and not result.ok, (result.limits, out)
    elif case == "imports_the_trainer":
        assert "IMPORTED" not in out and out.count("ModuleNotFoundError") == 3, out


def check_nothing_escaped(result, world: dict) -> None:
    assert not sandbox_processes(), "a sandboxed process outlived its run"
    assert not processes_named(world["marker"])
    assert world["secret"] not in result.stdout + result.stderr
    assert snapshot(world["guarded"]) == world["before"]
    assert not (PROJECT / "pwned.txt").exists() and not Path("/pwned").exists() and not Path("/usr/pwned").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_program_is_contained_in_namespaces(case, world):
    sandbox = Sandbox(limits=LIMITS, isolation="namespaces")
    result = sandbox.run_python(program(case, world))
    check_contained(case, result, world)
    check_nothing_escaped(result, world)
    assert result.seconds < LIMITS.wall_s + 2


RLIMITS_CONTAINS = [  # (memfd and the keyring only where libseccomp is installed, so not claimed)
    "loops_forever",
    "fork_bomb",
    "allocates_until_killed",
    "floods_stdout",
    "leaves_a_sleeping_child",
    "reads_environment",
]


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="rlimits contain a fork bomb and new sessions through a uid of their own, which takes a root trainer",
)
@pytest.mark.parametrize("case", RLIMITS_CONTAINS)
def test_rlimits_contain_what_they_claim(case, world):
    result = Sandbox(limits=LIMITS, isolation="rlimits").run_python(program(case, world))
    if case == "reads_environment":  # the program's own environment is scrubbed; /proc is the host's
        assert world["secret"] not in result.stdout
    else:
        check_contained(case, result, world)
    check_nothing_escaped(result, world)


def test_training_goes_on_while_its_reward_runs_the_hostile_programs(tmp_path, tiny_model_dir, world):
    """An actual training run whose "completions" are the hostile programs: each row names one, the reward runs it
    in the sandbox (in place of what the tiny model wrote) and checks it was contained. Every step trains and logs,
    and nothing escapes."""
    import math

    from datasets import Dataset

    from trl_async import AsyncGRPOTrainer

    from ..conftest import async_args

    sandbox = Sandbox(limits=LIMITS, isolation="namespaces")
    names = list(CASES)
    # 20 rows, each consumed once by 5 steps of 4 groups: every program runs
    dataset = Dataset.from_list([{"prompt": f"q{i}:", "case": names[i % len(names)]} for i in range(20)])
    assert len(names) <= 20, "more programs than rows: raise max_steps"
    ran = []

    def hostile_reward(completions, case, **kwargs):
        results = [sandbox.run_python(program(name, world)) for name in case]
        for name, result in zip(case, results, strict=True):
            check_contained(name, result, world)
            ran.append((name, result.stdout + result.stderr))
        return [float(result.ok) for result in results]

    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=hostile_reward,
                               args=async_args(tmp_path, max_steps=5, num_generations=2, rollout_timeout_s=120),
                               train_dataset=dataset)  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 5 and len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert len({name for name, _ in ran}) == len(names)  # every program ran at least once
    assert world["secret"] not in json.dumps(trainer.state.log_history) + "".join(text for _, text in ran)
    assert not sandbox_processes() and not processes_named(world["marker"])
    assert snapshot(world["guarded"]) == world["before"]


NON_ROOT_DRIVER = """
import dataclasses, json, sys, types
package = types.ModuleType("trl_async")  # the sandbox alone: the package's __init__ imports torch
package.__path__ = [sys.argv[1] + "/trl_async"]
sys.modules["trl_async"] = package
from trl_async.sandbox import Limits, Sandbox
sandbox = Sandbox(limits=Limits(**json.loads(sys.argv[2])), isolation="namespaces")
for name, source in json.loads(sys.stdin.read()).items():
    print(json.dumps([name, dataclasses.asdict(sandbox.run_python(source))]), flush=True)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not Path("/usr/bin/setpriv").exists(),
    reason="runs a trainer as an unprivileged user: needs root to switch, /usr/bin/python3 and setpriv",
)
def test_a_non_root_trainer_contains_the_same_programs(world):
    """A trainer that is not root gets the same containment from a user namespace (root inside it, with every
    capability dropped). The trainer here is the system Python run as ``nobody``, with the sandbox package alone."""
    import dataclasses

    from trl_async.sandbox import SandboxResult

    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user",
                            "--map-root-user", "--pid", "--fork", "--mount", "true"], capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces are refused here: {probe.stderr.decode().strip()}")
    limits = {f.name: getattr(LIMITS, f.name) for f in dataclasses.fields(LIMITS)}
    sources = {case: program(case, world) for case in CASES}
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                           "-c", NON_ROOT_DRIVER, str(PROJECT), json.dumps(limits)], input=json.dumps(sources),
                          capture_output=True, text=True, timeout=300, env={"PATH": os.defpath})  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    assert set(results) == set(CASES)
    for case, fields in results.items():
        result = SandboxResult(**{**fields, "limits": tuple(fields["limits"])})
        check_contained(case, result, world)
        check_nothing_escaped(result, world)
    assert not processes_owned_by(65534)


def processes_owned_by(uid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(entry)
        except FileNotFoundError:
            pass
    return found


def test_concurrent_runs_of_two_sandboxes_never_share_a_uid():
    """Each run holds a uid of its own (a lock file per uid), whichever sandbox object or process starts it: a run
    cannot use up another's process limit, nor be killed with it."""
    from concurrent.futures import ThreadPoolExecutor

    if os.geteuid() != 0:
        pytest.skip("a uid per run is for root trainers")
    first, second = Sandbox(limits=LIMITS, concurrency=2), Sandbox(limits=LIMITS, concurrency=2)
    source = "import os, time\ntime.sleep(0.5)\nprint(os.getuid())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda sandbox: sandbox.run_python(source), [first, second, first, second]))
    uids = [int(r.stdout) for r in results]
    assert len(set(uids)) == 4 and all(r.ok for r in results)


TRAINER_DRIVER = """
import sys, types
package = types.ModuleType("trl_async")
package.__path__ = [sys.argv[1] + "/trl_async"]
sys.modules["trl_async"] = package
from trl_async.sandbox import Limits, Sandbox
marker = sys.stdin.readline().strip()  # not on the command line, where the test looks for the run's processes
Sandbox(limits=Limits(wall_s=120, cpu_s=120)).run_python(
    "import subprocess, time\\nsubprocess.Popen(['/bin/sleep', %r], start_new_session=True)\\ntime.sleep(120)" % marker
)
"""


def test_a_killed_trainer_takes_its_runs_with_it(world):
    """The trainer dies mid-run (SIGKILL, no clean-up of its own): the run's launcher sees its pipe close and ends
    the run at once, long before the run's wall clock."""
    import time

    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_DRIVER, str(PROJECT)], stdin=subprocess.PIPE, text=True)
    trainer.stdin.write(world["marker"] + "\n")
    trainer.stdin.flush()
    deadline = time.monotonic() + 30
    while not processes_named(world["marker"]):  # the run is under way
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 5
    while processes_named(world["marker"]) or sandbox_processes():
        assert time.monotonic() < deadline, "the run outlived its trainer"
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid lock folder is for root trainers")
@pytest.mark.parametrize("plant", ["folder_of_another_user", "open_folder", "link"])
def test_a_uid_lock_folder_planted_by_another_user_is_refused(plant, tmp_path, monkeypatch):
    """Another local user who creates the lock folder first (or a link in its place) could make root create files
    where the links point, hold every uid, or make two runs share one: the sandbox refuses such a folder, and writes
    nothing through it."""
    from trl_async.sandbox import SandboxError, runner

    folder, target = tmp_path / "uids", tmp_path / "target"
    target.mkdir(mode=0o700)
    if plant == "link":
        folder.symlink_to(target)
    else:
        folder.mkdir(mode=0o777 if plant == "open_folder" else 0o700)
        os.chmod(folder, 0o777 if plant == "open_folder" else 0o700)
        if plant == "folder_of_another_user":
            os.chown(folder, 65534, 65534)
            (folder / str(runner.UID_BASE)).symlink_to(target / "written_by_root")
    monkeypatch.setattr(runner, "UID_LOCKS", str(folder))
    with pytest.raises(SandboxError, match="uid lock folder"):
        Sandbox(limits=LIMITS).run_python("print(1)")
    assert not list(target.iterdir())


CONCURRENT_DRIVER = """
import json, sys, types
from concurrent.futures import ThreadPoolExecutor
package = types.ModuleType("trl_async")
package.__path__ = [sys.argv[1] + "/trl_async"]
sys.modules["trl_async"] = package
from trl_async.sandbox import Limits, Sandbox
sandbox = Sandbox(limits=Limits(processes=12, wall_s=20), isolation="namespaces", concurrency=3)
source = (
    "import subprocess, time\\n"
    "children = [subprocess.Popen(['/bin/sleep', '1']) for _ in range(8)]\\n"
    "[c.wait() for c in children]\\n"
    "print('started', len(children))\\n"
)
with ThreadPoolExecutor(3) as pool:
    results = list(pool.map(lambda _: sandbox.run_python(source), range(3)))
print(json.dumps([[r.stdout, list(r.limits), r.exit_code] for r in results]))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not Path("/usr/bin/setpriv").exists(),
    reason="runs a trainer as an unprivileged user: needs root to switch, /usr/bin/python3 and setpriv",
)
def test_a_non_root_trainers_runs_count_their_processes_apart():
    """The process limit counts per user and user namespace: each run of a non-root trainer has a user namespace of
    its own, so three runs of 9 processes each, at once, all fit a limit of 12."""
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                           "-c", CONCURRENT_DRIVER, str(PROJECT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": os.defpath})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [["started 8\n", [], 0]] * 3
    assert not processes_owned_by(65534)


CLOSING_DRIVER = """
import ctypes, json, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: whatever the zygote leaves behind comes here
from trl_async.sandbox import Sandbox
left = {}
for isolation in sys.argv[1:]:
    for attempt in range(3):
        sandbox = Sandbox(isolation=isolation)
        for _ in range(2):
            assert sandbox.run_python("print('done')").stdout == "done\\n"
        sandbox.close()
        try:
            orphan, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            continue
        left.setdefault(isolation, []).append(orphan)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
print(json.dumps(left))
"""


def test_a_closed_sandbox_has_reaped_every_process_of_its_runs():
    """Once ``close`` returns, the zygote has reaped every launcher it forked and then ended: none is handed to the
    machine's init, which may never reap it (a zombie of a sandbox uid, left for the life of the machine)."""
    from trl_async.sandbox.isolation import namespaces_refusal

    isolations = ["rlimits"] + ([] if namespaces_refusal() else ["namespaces"])
    done = subprocess.run([sys.executable, "-c", CLOSING_DRIVER, *isolations], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {}
