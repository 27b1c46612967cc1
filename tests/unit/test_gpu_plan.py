"""The GPU plan's pure parts: pieces cut into calls and joined back, time boxes, the budget page against the code, and a
phase's process killed at the end of its box with everything it started."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_plan  # noqa: E402
from gpu_plan import CALLS, PHASES, PLAN_S, SIDE_GRACE_S, Phase, box_for, pack  # noqa: E402

pytestmark = pytest.mark.unit


def test_pack_cuts_pieces_in_order_into_calls_of_at_most_the_cap():
    # worked by hand: a(5) fills call 1 but one byte, b(7) takes that byte and 6 of call 2, c(3) goes to call 3
    assert pack([("a", 5), ("b", 7), ("c", 3)], cap=6) == [
        [("a", 0, 5), ("b", 0, 1)],
        [("b", 1, 6)],
        [("c", 0, 3)],
    ]
    assert pack([("a", 6)], cap=6) == [[("a", 0, 6)]]  # exactly full: no empty call after it


def pieces(tmp_path: Path, sizes=(3000, 2000, 9000)) -> dict:
    out = {}
    for name, size in zip(gpu_plan.PIECES, sizes, strict=True):
        out[name] = tmp_path / f"{name}.bin"
        out[name].write_bytes(bytes((i * 7 + len(name)) % 251 for i in range(size)))
    return out


def test_pieces_travel_in_calls_and_join_back_exactly(tmp_path):
    source = pieces(tmp_path)
    manifest = gpu_plan.write_calls(source, tmp_path / "calls", cap=4000)
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    complete_after = []
    for call in range(1, CALLS + 1):
        for part in (tmp_path / "calls" / f"call{call}").glob("*.part"):
            assert part.stat().st_size <= 4000
            part.rename(arrived / part.name)
        complete_after.append(gpu_plan.complete_pieces(manifest, arrived))
    # 14000 bytes in calls of 4000: vllm whole in call 1, wheels ends in call 2, the model in call 4
    assert complete_after == [["vllm"], ["vllm", "wheels"], ["vllm", "wheels"], ["vllm", "wheels", "model"]]
    for name, path in source.items():
        gpu_plan.join_piece(manifest, name, arrived, tmp_path / f"{name}.joined")
        assert (tmp_path / f"{name}.joined").read_bytes() == path.read_bytes()


def test_a_damaged_part_is_caught_when_its_piece_is_joined(tmp_path):
    manifest = gpu_plan.write_calls(pieces(tmp_path), tmp_path / "calls", cap=4000)
    part = next((tmp_path / "calls" / "call4").glob("model.*.part"))
    part.write_bytes(part.read_bytes()[:-1] + b"\x00")  # one byte changed in transit
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    for file in (tmp_path / "calls").glob("call*/*.part"):
        file.rename(arrived / file.name)
    with pytest.raises(RuntimeError, match="model does not match its SHA-256"):
        gpu_plan.join_piece(manifest, "model", arrived, tmp_path / "model.joined")


def test_pieces_that_need_more_calls_than_the_plan_has_are_refused(tmp_path):
    with pytest.raises(ValueError, match="need 5 calls"):
        gpu_plan.write_calls(pieces(tmp_path), tmp_path / "calls", cap=3000)


def test_a_box_is_cut_short_by_the_deadline_and_can_be_overridden():
    phase = Phase("p", "main", (), box_s=100, dry_box_s=10)
    assert box_for(phase, dry=False, now=0, deadline=1000) == 100
    assert box_for(phase, dry=True, now=0, deadline=1000) == 10
    assert box_for(phase, dry=False, now=950, deadline=1000) == 50
    assert box_for(phase, dry=False, now=1001, deadline=1000) == 0
    assert box_for(phase, dry=False, now=0, deadline=1000, overrides={"p": 3}) == 3


def page_rows() -> list[list[str]]:
    text = (ROOT / "benchmarks/GPU_PLAN.md").read_text()
    table = re.search(r"<!-- phases:begin -->(.*?)<!-- phases:end -->", text, re.S).group(1)
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]


def test_the_budget_page_has_the_codes_phases_and_boxes_and_adds_up_to_12_minutes():
    rows = page_rows()
    assert [(r[0], r[1], int(r[2])) for r in rows] == [(p.name, p.track, p.box_s) for p in PHASES]
    expected = {r[0]: int(r[3]) for r in rows}
    assert all(expected[p.name] <= p.box_s for p in PHASES)
    text = (ROOT / "benchmarks/GPU_PLAN.md").read_text()
    staging = [int(x) for x in re.findall(r"^\| (?:the machine's start|call \d:[^|]*) \| (\d+) \|", text, re.M)]
    assert len(staging) == 5
    side_start, main_start = sum(staging[:3]), sum(staging)
    side_end = side_start + sum(expected[p.name] for p in PHASES if p.track == "side")
    before_alone = [p for p in PHASES if p.track == "main" and not p.alone]
    alone = [p for p in PHASES if p.track == "main" and p.alone]
    assert PHASES.index(before_alone[-1]) < PHASES.index(alone[0])  # the alone phases come last
    ready = main_start + sum(expected[p.name] for p in before_alone)
    assert side_end - ready <= SIDE_GRACE_S  # the verdicts end before the grace runs out
    end = max(ready, side_end) + sum(expected[p.name] for p in alone)
    assert f"about **{end} s**" in text
    # the deadline counts from call 1's start (after the machine's start and call 1's transfer): the expected
    # plan ends before it, and with a 2-minute start the deadline plus the results' return is at most 12 minutes
    assert end <= staging[0] + staging[1] + PLAN_S
    assert 120 + staging[1] + PLAN_S + 5 <= 720


def test_summarise_returns_what_ended_and_marks_the_rest(tmp_path):
    stage, out = tmp_path / "stage", tmp_path / "out"
    (stage / "results" / "bench").mkdir(parents=True)
    (stage / "logs").mkdir()
    (stage / "logs" / "zero3.log").write_text("trained")
    (stage / "results" / "zero3.json").write_text(json.dumps({"phase": "zero3", "status": "ok"}))
    (stage / "results" / "bench" / "gpu_bench.json").write_text("{}")
    plan = gpu_plan.summarise(stage, out)
    assert plan["phases"]["zero3"]["status"] == "ok" and plan["phases"]["async_s1"] == {"status": "not ended"}
    assert not plan["done"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_bench.json", "logs.tgz", "plan.json"]


def test_a_phase_past_its_box_is_killed_with_the_processes_it_started_in_sessions_of_their_own(tmp_path):
    from gpu_runner import Runner

    runner = Runner(tmp_path / "stage", dry=True, deadline=time.time() + 60)
    pid_file = tmp_path / "child.pid"
    # a child in a session of its own, as a launcher's ranks are: a group kill alone would miss it
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(c.pid)); "
              f"time.sleep(60)")  # fmt: skip
    began = time.time()
    outcome = runner.command(Phase("slow", "main", (), 1, 1), [sys.executable, "-c", script], box=2)
    assert outcome == {"status": "cut", "why": "its box of 2 s ran out"} and time.time() - began < 10
    child = int(pid_file.read_text())
    time.sleep(0.5)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    assert state == "" or state.startswith("Z"), f"the child is still running ({state})"


def test_the_side_track_is_stopped_for_a_phase_that_needs_the_gpu_alone(tmp_path):
    from gpu_runner import Runner

    runner = Runner(tmp_path / "stage", dry=True, deadline=time.time() + 60)
    runner.stop_side.set()
    outcome = runner.command(Phase("verdict", "side", (), 30, 30), [sys.executable, "-c", "import time; time.sleep(30)"],
                             box=30)  # fmt: skip
    assert outcome == {"status": "cut", "why": "the main track needed the GPU alone"}
