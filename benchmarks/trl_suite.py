"""TRL's own GRPOTrainer tests, run twice: as written, and with ``trl.GRPOTrainer`` replaced by ``AsyncGRPOTrainer``.

Drop-in means that a test GRPOTrainer passes, AsyncGRPOTrainer passes too, or the difference has a reason that is
true. TRL's tests load their tiny models and datasets from the Hub (``trl-internal-testing/...``); offline, this script
builds local stand-ins under the same names (``trl_standins.py``) and runs the tests from a folder where those names
are local paths. A test that needs a model with no stand-in fails the same way under both classes. With ``--before
REV`` the swapped-in tests also run against this project's package as it was at commit REV, and every test whose
outcome changed since is listed. TRL skips its tool and environment tests without ``jmespath`` (``pip install
jmespath`` to run them).

    python benchmarks/trl_suite.py --tests <a TRL checkout>/tests [-k EXPR] [--before REV] [--only async --update]

Writes ``<out>.json`` (every selected test's outcome under each class, the first line of each failure) and
``<out>.md`` (the counts, and every test whose outcome differs). ``--update`` merges a run of some tests into the saved
result instead of replacing it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_standins import build_standins  # noqa: E402

SWAP = '''"""Loaded with -p, in both runs: an ``is_*_available`` check the tests import and this TRL lacks answers False
(tests written for another TRL release); under TRL_SUITE_CLASS=async, `from trl import GRPOTrainer` gives
AsyncGRPOTrainer."""
import importlib
import importlib.util
import os

VISION_MODEL = "{vision_model}"


def _missing(name):
    if name.startswith("is_") and name.endswith("_available"):
        return lambda *args, **kwargs: False
    raise AttributeError(name)


importlib.import_module("trl.import_utils").__getattr__ = _missing

# Qwen-VL processors load for images alone where torchvision (their video processor's) is missing
_spec = importlib.util.spec_from_file_location("trl_suite_vision_model", VISION_MODEL)
_vision_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vision_model)
_vision_model.images_only_qwen_vl()

if os.environ.get("TRL_SUITE_CLASS") == "async":
    import trl
    from trl_async import AsyncGRPOTrainer

    trl.GRPOTrainer = AsyncGRPOTrainer
    _built = [0]
    _init = AsyncGRPOTrainer.__init__

    def _counted(self, *args, **kwargs):
        _built[0] += 1
        return _init(self, *args, **kwargs)

    AsyncGRPOTrainer.__init__ = _counted

    def pytest_sessionfinish(session):  # evidence that the swap took: how many AsyncGRPOTrainers the tests built
        with open(os.environ["TRL_SUITE_BUILT"], "w") as f:
            f.write(str(_built[0]))
'''


META = ("trl", "tests_from", "select", "before", "parts")  # what a result says about its run, beside the runs
MARK = ".trl_suite_work"  # a work folder this script made, and may empty again


def prepare(work: Path, tests: Path) -> None:
    if work.exists():
        if not (work / MARK).exists():
            raise ValueError(f"--work {work} exists and was not made by this script: name a new folder")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARK).touch()
    hub = work / "trl-internal-testing"
    hub.mkdir()
    build_standins(hub)
    shutil.copytree(tests, work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "trl_suite_swap.py").write_text(SWAP.replace("{vision_model}", str(ROOT / "tests/vision_model.py")))


def extract_before(work: Path, rev: str) -> str:
    """This project's package as it was at ``rev``, under ``<work>/before``; returns the full commit."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    target = work / "before"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    archive = subprocess.run(
        ["git", "archive", commit.strip(), "trl_async"], cwd=ROOT, check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return commit.strip()


def run(work: Path, which: str, select: str | None, timeout_s: int) -> dict:
    report = work / f"junit_{which}.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/test_grpo_trainer.py", "-p", "trl_suite_swap", "-q",
           "-p", "no:cacheprovider", f"--junitxml={report}", f"--timeout={timeout_s}", "-W", "ignore"]  # fmt: skip
    if select:
        cmd += ["-k", select]
    # "before": AsyncGRPOTrainer from the package at an earlier commit, found ahead of the installed one
    path = f"{work / 'before'}{os.pathsep}{work}" if which == "before" else str(work)
    env = {**os.environ, "TRL_SUITE_CLASS": "grpo" if which == "grpo" else "async", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRL_SUITE_BUILT": str(work / f"built_{which}")}  # fmt: skip
    started = time.monotonic()
    subprocess.run(cmd, cwd=work, env=env, check=False)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report ({which}): see its output above")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                lines = (found.get("message") or found.text or "").strip().splitlines()
                why = lines[0][:300] if lines else ""
                break
        outcomes[name] = {"outcome": outcome, "why": why, "seconds": round(float(case.get("time", 0)), 1)}
    built = work / f"built_{which}"
    result = {"seconds": round(time.monotonic() - started), "tests": outcomes}
    if which != "grpo":
        result["async_trainers_built"] = int(built.read_text()) if built.exists() else 0
    return result


def summarise(runs: dict, meta: dict) -> tuple[dict, str]:
    names = sorted(set(runs["grpo"]["tests"]) | set(runs["async"]["tests"]))
    counts = {
        which: {k: sum(t["outcome"] == k for t in runs[which]["tests"].values())
                for k in ("passed", "failed", "error", "skipped")}
        for which in runs
    }  # fmt: skip
    pairs = [(n, runs["grpo"]["tests"].get(n, {}), runs["async"]["tests"].get(n, {})) for n in names]
    differ = [(n, g, a) for n, g, a in pairs if g.get("outcome") != a.get("outcome")]
    # failing under both classes, but not for the same reason: the swap may hide a difference behind the failure
    both = [(n, g, a) for n, g, a in pairs
            if g.get("outcome") == a.get("outcome") in ("failed", "error") and g.get("why") != a.get("why")]  # fmt: skip
    causes = baseline_causes(runs["grpo"]["tests"])
    before = runs.get("before", {}).get("tests", {})
    # the project at an earlier commit against now: a test it passed that fails now is a regression
    changed = [(n, before[n], runs["async"]["tests"].get(n, {})) for n in sorted(before)
               if before[n]["outcome"] != runs["async"]["tests"].get(n, {}).get("outcome")]  # fmt: skip
    result = {**meta, "counts": counts, "runs": runs, "baseline_causes": causes,
              "differ": [{"test": n, "grpo": g, "async": a} for n, g, a in differ],
              "fail_both_differently": [{"test": n, "grpo": g, "async": a} for n, g, a in both],
              "before_changed": [{"test": n, "before": b, "async": a} for n, b, a in changed]}  # fmt: skip
    label = {"grpo": "GRPOTrainer", "async": "AsyncGRPOTrainer",
             "before": f"AsyncGRPOTrainer at {meta.get('before', '')[:7]} (earlier)"}  # fmt: skip
    lines = [
        f"# TRL's GRPOTrainer tests with the class swapped in (TRL {meta['trl']}, tests from {meta['tests_from']})",
        "",
        "| class | passed | failed | error | skipped | wall s |",
        "|---|---|---|---|---|---|",
        *(f"| {label[w]} | {c['passed']} | {c['failed']} | {c['error']} "
          f"| {c['skipped']} | {runs[w]['seconds']} |" for w, c in counts.items()),
        "",
        "(wall s: each class's time, summed over its runs; not a speed comparison: tiny models, and each test starts"
        " its own workers.)",
        "",
        f"Selected: `{meta['select'] or 'all'}`{assembled(meta)}. AsyncGRPOTrainers the tests built (the swapped "
        f"run, all its parts): {runs['async'].get('async_trainers_built', 0)}. Tests whose outcome differs:",
        "",
        "| test | GRPOTrainer | AsyncGRPOTrainer | why (AsyncGRPOTrainer) |",
        "|---|---|---|---|",
        *(f"| `{n}` | {g.get('outcome')} | {a.get('outcome')} | {cell(a.get('why', ''))} |" for n, g, a in differ),
        "",
        "Tests that fail under both classes, for different reasons (the swap may show behind such a failure):",
        "",
        "| test | why (GRPOTrainer) | why (AsyncGRPOTrainer) |",
        "|---|---|---|",
        *(f"| `{n}` | {cell(g.get('why', ''))} | {cell(a.get('why', ''))} |" for n, g, a in both),
        "",
        *([f"The project at {meta['before'][:7]} against now: every test whose outcome changed "
           f"({len(changed)}).", "", "| test | earlier | now | why (earlier) |", "|---|---|---|---|",
           *(f"| `{n}` | {b['outcome']} | {a.get('outcome')} | {cell(b.get('why', ''))} |" for n, b, a in changed),
           ""] if before else []),
        "Why tests fail or are skipped under GRPOTrainer itself (these say nothing about the swap):",
        "",
        "| cause | tests |",
        "|---|---|",
        *(f"| {cell(cause)} | {n} |" for cause, n in causes.items()),
    ]  # fmt: skip
    return result, "\n".join(lines) + "\n"


def assembled(meta: dict) -> str:
    """How a result merged from several runs (``--update``) was assembled, run by run; nothing for a single run."""
    parts = meta.get("parts", [])
    if len(parts) < 2:
        return ""
    runs = "; ".join(f"{'+'.join(p['classes'])}: `{p['select']}`" for p in parts)
    return f", assembled from {len(parts)} runs, each one's outcomes replacing the earlier ones of its tests ({runs})"


def cell(text: str) -> str:
    return text.replace("|", "/")[:240]


def baseline_causes(tests: dict) -> dict[str, int]:
    """GRPOTrainer's own failures and skips, grouped by the kind of their first line: a Hub model or dataset without
    a stand-in here, a missing package, or anything else (by its exception type)."""
    causes: dict[str, int] = {}
    for t in tests.values():
        if t["outcome"] == "passed":
            continue
        why = t["why"]
        if "trl-internal-testing" in why or "huggingface.co" in why or "OfflineModeIsEnabled" in why:
            cause = "loads a Hub model or dataset with no local stand-in"
        elif why.startswith("IndexError: index out of range in self"):  # each such test mocks generate()
            cause = "mocks generate with the real tokenizer's token ids, past the stand-in's vocabulary"
        elif t["outcome"] == "skipped":
            cause = f"skipped: {why.split(':')[-1].strip()[:80]}"
        else:
            cause = f"other ({why.split(':')[0][:60]})"
        causes[cause] = causes.get(cause, 0) + 1
    return dict(sorted(causes.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="a TRL checkout's tests/ folder")
    parser.add_argument("--summarise", type=Path, help="write the tables again from a saved <out>.json, run nothing")
    parser.add_argument(
        "--tests_from", default="", help="what the tests are (a TRL version or commit), for the report"
    )
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl_suite"), help="a scratch folder this script owns")
    parser.add_argument("--timeout_s", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/trl_grpo_suite")
    parser.add_argument("--before", help="also run AsyncGRPOTrainer as it was at this commit (a git revision)")
    parser.add_argument("--only", help="run only these of grpo,async,before (comma-separated)")
    parser.add_argument(
        "--update",
        action="store_true",
        help="merge this run's tests into the saved <out>.json instead of replacing it",
    )
    cli = parser.parse_args()
    if cli.only and "before" in cli.only.split(",") and not cli.before:
        parser.error("--only before needs --before REV (the commit to run)")
    if cli.summarise:
        saved = json.loads(cli.summarise.read_text())
        runs, meta = saved["runs"], {k: v for k, v in saved.items() if k in META}
    elif cli.tests is None:
        parser.error("--tests (a TRL checkout's tests/ folder) or --summarise (a saved result) is required")
    else:
        import trl

        saved = json.loads(cli.out.with_suffix(".json").read_text()) if cli.update else {"runs": {}}
        meta = {k: v for k, v in saved.items() if k in META}
        meta.update(trl=trl.__version__, tests_from=cli.tests_from or meta.get("tests_from") or str(cli.tests))
        if not cli.update:
            meta["select"] = cli.select
        prepare(cli.work, cli.tests.resolve())
        if cli.before:
            commit = extract_before(cli.work, cli.before)
            if meta.get("before", commit) != commit and "before" in saved["runs"]:
                parser.error(f"--update: the saved result ran --before {meta['before'][:7]}, not {commit[:7]}")
            meta["before"] = commit
        classes = cli.only.split(",") if cli.only else ["grpo", "async", *(["before"] if cli.before else [])]
        # what each run of an assembled result ran: the selection, and the classes (a later run's outcomes replace)
        meta["parts"] = [*meta.get("parts", []), {"classes": classes, "select": cli.select}]
        runs = saved["runs"]
        for which in classes:
            fresh = run(cli.work, which, cli.select, cli.timeout_s)
            if which in runs:  # --update: this run's tests replace the saved ones of the same name
                fresh["tests"] = {**runs[which]["tests"], **fresh["tests"]}
                fresh["seconds"] += runs[which]["seconds"]
                if which != "grpo":
                    fresh["async_trainers_built"] += runs[which].get("async_trainers_built", 0)
            runs[which] = fresh
    result, table = summarise(runs, meta)
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    cli.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    cli.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
