"""Experiment tracking: a real run with ``report_to=["tensorboard"]`` writes GRPOTrainer's metrics and the ``async/``
and ``is/`` metrics docs/metrics.md documents to TensorBoard's event files, one finite value per logged step."""

import math
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, letter_reward, text_dataset

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# logged only under settings this run does not use (trl_async/reporting/progress.py, batch_metrics): dynamic_sampling for the
# first two, environments for the last
CONDITIONAL = {"async/filtered_groups", "async/filtered_frac", "async/abandoned_groups"}

# GRPOTrainer's and the Trainer's own metrics, as transformers' TensorBoardCallback names them
TRL_TAGS = {
    "train/loss",
    "train/grad_norm",
    "train/learning_rate",
    "train/reward",
    "train/reward_std",
    "train/rewards/letter_reward/mean",
    "train/completions/mean_length",
    "train/clip_ratio/region_mean",
}


def documented_metrics(max_staleness: int) -> set[str]:
    """The ``async/`` and ``is/`` names in the first column of docs/metrics.md's tables, with the staleness histogram
    (documented as ``async/staleness_k0`` … ``k{max_staleness}``) spelt out for ``max_staleness``."""
    text = METRICS_DOC.read_text()
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`((?:async|is)/\w+)`", line.split("|")[1]))
    assert "async/staleness_k0" in names and "`k{max_staleness}`" in text
    return names | {f"async/staleness_k{k}" for k in range(max_staleness + 1)}


def test_tensorboard_gets_trl_async_and_is_metrics_once_per_logged_step(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)  # transformers' default: <output_dir>/runs/<run>
    steps, max_staleness = 3, 1
    args = async_args(tmp_path, max_steps=steps, max_staleness=max_staleness, report_to=["tensorboard"])
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()

    (run_dir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every value
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert TRL_TAGS <= tags, sorted(TRL_TAGS - tags)

    # every always-logged documented metric is there under its documented name, and nothing undocumented is
    documented = documented_metrics(max_staleness)
    logged = {t.removeprefix("train/") for t in tags if t.startswith(("train/async/", "train/is/"))}
    assert sorted(documented - CONDITIONAL - logged) == []
    assert sorted(logged - documented) == []

    history = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    assert sorted(history) == list(range(1, steps + 1))
    for name in sorted(logged):
        scalars = events.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == list(range(1, steps + 1)), name
        assert all(math.isfinite(s.value) for s in scalars), (name, [s.value for s in scalars])
        # the tracker's value is the one in state.log_history (the console's), under the same name
        assert [s.value for s in scalars] == pytest.approx([history[s.step][name] for s in scalars], rel=1e-6), name

    # each step's histogram counts that step's batch; the bound and ESS ranges hold in what the tracker got
    for step in range(1, steps + 1):
        histogram = [events.Scalars(f"train/async/staleness_k{k}")[step - 1].value for k in range(max_staleness + 1)]
        assert sum(histogram) == args.per_device_train_batch_size
    assert max(s.value for s in events.Scalars("train/async/staleness_max")) <= max_staleness
    assert all(0.0 <= s.value <= 1.0 for s in events.Scalars("train/is/ess"))
    # everything the run logged reached the tracker, as "train/" + its log_history key
    assert sorted({f"train/{k}" for h in trainer.state.log_history for k in h if k != "step"} - tags) == []
