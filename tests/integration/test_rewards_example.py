"""examples/rewards.py, run as docs/datasets.md says to run it: it trains on the real SmolLM2-135M-Instruct and asserts
what its reward functions received (one group per call, the dataset column, a background thread), then prints it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_rewards_example_runs_and_its_rewards_receive_what_the_page_says():
    page = (ROOT / "docs" / "datasets.md").read_text("utf-8")
    assert "python examples/rewards.py" in page  # the command run below
    # the environment as the test session has it (conftest.py: OMP_NUM_THREADS=1 unless set)
    done = subprocess.run(
        [sys.executable, "examples/rewards.py"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    calls = int(re.search(r"reward calls: (\d+), each with the 4 completions of one prompt", out).group(1))
    assert calls >= 8  # 4 steps x 2 groups
    threads = re.search(r"sync rewards ran on: \[(.*)\], async ones on: \[(.*)\]", out)
    assert re.fullmatch(r"'trl_async-score-\d+'(, 'trl_async-score-\d+')*", threads.group(1))
    assert threads.group(2) == "'GRPOTrainer-AsyncLoop'"  # GRPOTrainer's own event loop
    assert re.search(r"trainer_state.global_step when scored: \[0, ", out)
    assert len(re.search(r"judge/words per step: \[(.*)\]", out).group(1).split(",")) == 4  # log_metric, every step
