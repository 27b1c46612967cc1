"""The results tables of README.md and docs/benchmarks.md are what benchmarks/results/*.json say
(benchmarks/summary.py), and a wrong number in either place is caught."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import summary  # noqa: E402


def test_the_committed_tables_are_the_results():
    assert summary.stale() == {}, "run python benchmarks/summary.py"


@pytest.fixture
def pages(tmp_path):
    for page in summary.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    return tmp_path


def test_a_wrong_number_on_the_front_page_is_caught(pages):
    readme = pages / "README.md"
    text = readme.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| a slow verifier"))
    assert "1.56× tokens/s" in row  # throughput.json: 1.564 (async η=1, 4 scorers) against the fastest GRPOTrainer
    readme.write_text(text.replace(row, row.replace("1.56× tokens/s", "1.98× tokens/s")))
    assert list(summary.stale(pages)) == ["README.md"]


def test_a_changed_result_changes_both_tables(pages, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    for path in summary.RESULTS.glob("*.json"):
        shutil.copy(path, results / path.name)
    agentic = json.loads((results / "agentic.json").read_text())
    next(r for r in agentic["summary"] if r["config"] == "async η=8")["tokens_vs_best_sync"] = 9.5
    (results / "agentic.json").write_text(json.dumps(agentic))
    fixed = summary.stale(pages, results)
    assert set(fixed) == set(summary.PAGES)
    assert all("9.50× (η=8)" in text for text in fixed.values())


def test_rows_worked_out_by_hand():
    rows = {(r.setting, r.source): r for r in summary.build(summary.load())}
    pinned = rows["generation on a core of its own", "dedicated_128_tta"]
    # dedicated_128_tta.json: ded_async_s1 1.403x the tokens/s of ded_sync; 371 and 394 completion tokens per step
    # (completion_tokens / steps averaged over the 3 seeds of each)
    assert pinned.result.startswith("1.40× tokens/s") and "371 against 394" in pinned.machine
    assert pinned.baseline == summary.PINNED and pinned.bound == "1.38" and pinned.seeds == "3"
    split = rows["a core per phase, against GRPOTrainer on both cores", "dedicated_32_shared"]
    # dedicated_32_shared.json, against ded_sync: GRPOTrainer 1.791, pinned async 1.211, ded_sync itself 1
    assert split.result.startswith(f"{1.211 / 1.791:.2f}× tokens/s") and split.result.endswith(f"{1 / 1.791:.2f}×")
    long_tail = next(r for (setting, _), r in rows.items() if setting.startswith("long-tailed"))
    assert "learning rate 0" in long_tail.setting and long_tail.seeds == "3 repeats"
    assert all(r.machine.startswith("2-core") for r in rows.values())


@pytest.mark.parametrize(
    ("machine", "label"),
    [
        ({"cpu": "AMD EPYC", "native_bf16": False, "cpu_count": 2}, "2-core AMD EPYC (no native bf16)"),
        ({"cpu": "AMD EPYC", "native_bf16": True, "cpu_count": 2}, "2-core AMD EPYC (AVX512-BF16)"),
        ({"cpu": "Intel(R) Xeon(R) Processor", "native_bf16": True, "cpu_count": 2}, "2-core Intel Xeon (AMX)"),
        (
            {"cpu_count": 2},
            "2-core Intel Xeon (AMX; not recorded in the JSON, per benchmarks/ARCHIVE.md)",
        ),  # written before the CPU was recorded
    ],
)
def test_cpu_labels(machine, label):
    assert summary.cpu_label(machine) == label


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="results-table"):
        summary.splice("# no table here\n", "| a |")
