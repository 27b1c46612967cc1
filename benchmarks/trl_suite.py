"""TRL's own GRPOTrainer tests, run twice: as written, and with ``trl.GRPOTrainer`` replaced by ``AsyncGRPOTrainer``.

Drop-in means that a test GRPOTrainer passes, AsyncGRPOTrainer passes too, or the difference has a reason that is
true. TRL's tests load their tiny models and datasets from the Hub (``trl-internal-testing/...``); offline, this script
builds local stand-ins under the same names (models of the same classes, small and randomly initialised, with
SmolLM2's tokenizer; the "zen" prompt datasets from the Zen of Python) and runs the tests from a folder where those
names are local paths. A test that needs a model with no stand-in fails the same way under both classes.

    python benchmarks/trl_suite.py --tests <a TRL checkout>/tests [-k EXPR] [--out benchmarks/results/trl_grpo_suite]

Writes ``<out>.json`` (every selected test's outcome under each class, the first line of each failure) and
``<out>.md`` (the counts, and every test whose outcome differs)."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ("tiny-Qwen2ForCausalLM-2.5", "tiny-Qwen2ForSequenceClassification-2.5")
SWAP = '''"""Loaded with -p, in both runs: an ``is_*_available`` check the tests import and this TRL lacks answers False
(tests written for another TRL release); under TRL_SUITE_CLASS=async, `from trl import GRPOTrainer` gives
AsyncGRPOTrainer."""
import importlib
import os


def _missing(name):
    if name.startswith("is_") and name.endswith("_available"):
        return lambda *args, **kwargs: False
    raise AttributeError(name)


importlib.import_module("trl.import_utils").__getattr__ = _missing

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


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen of Python; its text is kept rot13-encoded in this.s)

    text = codecs.decode(sys.modules["this"].s, "rot13")
    return [line for line in text.splitlines()[1:] if line.strip()]


def build_zen(folder: Path) -> None:
    """``trl-internal-testing/zen``'s prompt-only configurations: a train split and a small test split."""
    from datasets import Dataset

    lines = zen_lines()
    prompts = [line.rsplit(" ", 1)[0] for line in lines]
    splits = {"train": prompts[:-2], "test": prompts[-2:]}
    configs = {
        "standard_prompt_only": lambda p: {"prompt": p},
        "conversational_prompt_only": lambda p: {"prompt": [{"role": "user", "content": f"Complete: {p}"}]},
    }
    card = ["---", "configs:"]
    for name, row in configs.items():
        card += [f"- config_name: {name}", "  data_files:"]
        for split, rows in splits.items():
            Dataset.from_list([row(p) for p in rows]).to_parquet(str(folder / name / f"{split}.parquet"))
            card += [f"  - split: {split}", f"    path: {name}/{split}.parquet"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))


def build_models(folder: Path) -> None:
    """Tiny Qwen2 models under TRL's test names, with SmolLM2's tokenizer (and chat template)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from trl_async.demo.pretrained import smollm2_135m_instruct

    tokenizer = AutoTokenizer.from_pretrained(smollm2_135m_instruct())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    for name, cls in zip(STANDINS, (Qwen2ForCausalLM, Qwen2ForSequenceClassification), strict=True):
        model = cls(Qwen2Config(**shape, num_labels=1) if "Sequence" in name else Qwen2Config(**shape))
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


MARK = ".trl_suite_work"  # a work folder this script made, and may empty again


def prepare(work: Path, tests: Path) -> None:
    if work.exists():
        if not (work / MARK).exists():
            raise ValueError(f"--work {work} exists and was not made by this script: name a new folder")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARK).touch()
    hub = work / "trl-internal-testing"
    (hub / "zen").mkdir(parents=True)
    build_zen(hub / "zen")
    build_models(hub)
    shutil.copytree(tests, work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "trl_suite_swap.py").write_text(SWAP)


def run(work: Path, which: str, select: str | None, timeout_s: int) -> dict:
    report = work / f"junit_{which}.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/test_grpo_trainer.py", "-p", "trl_suite_swap", "-q",
           "-p", "no:cacheprovider", f"--junitxml={report}", f"--timeout={timeout_s}", "-W", "ignore"]  # fmt: skip
    if select:
        cmd += ["-k", select]
    env = {**os.environ, "TRL_SUITE_CLASS": which, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRL_SUITE_BUILT": str(work / "async_trainers_built")}  # fmt: skip
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
    built = work / "async_trainers_built"
    result = {"seconds": round(time.monotonic() - started), "tests": outcomes}
    if which == "async":
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
    result = {**meta, "counts": counts, "runs": runs, "baseline_causes": causes,
              "differ": [{"test": n, "grpo": g, "async": a} for n, g, a in differ],
              "fail_both_differently": [{"test": n, "grpo": g, "async": a} for n, g, a in both]}  # fmt: skip
    lines = [
        f"# TRL's GRPOTrainer tests with the class swapped in (TRL {meta['trl']}, tests from {meta['tests_from']})",
        "",
        "| class | passed | failed | error | skipped | wall s |",
        "|---|---|---|---|---|---|",
        *(f"| {'GRPOTrainer' if w == 'grpo' else 'AsyncGRPOTrainer'} | {c['passed']} | {c['failed']} | {c['error']} "
          f"| {c['skipped']} | {runs[w]['seconds']} |" for w, c in counts.items()),
        "",
        "(wall s: each run's whole time, not a speed comparison: tiny models, and each test starts its own workers.)",
        "",
        f"Selected: `{meta['select'] or 'all'}`. AsyncGRPOTrainers the tests built in the swapped run: "
        f"{runs['async'].get('async_trainers_built', 0)}. Tests whose outcome differs:",
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
        "Why tests fail or are skipped under GRPOTrainer itself (these say nothing about the swap):",
        "",
        "| cause | tests |",
        "|---|---|",
        *(f"| {cell(cause)} | {n} |" for cause, n in causes.items()),
    ]  # fmt: skip
    return result, "\n".join(lines) + "\n"


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
    cli = parser.parse_args()
    if cli.summarise:
        saved = json.loads(cli.summarise.read_text())
        runs, meta = saved["runs"], {k: saved[k] for k in ("trl", "tests_from", "select")}
    elif cli.tests is None:
        parser.error("--tests (a TRL checkout's tests/ folder) or --summarise (a saved result) is required")
    else:
        import trl

        prepare(cli.work, cli.tests.resolve())
        runs = {which: run(cli.work, which, cli.select, cli.timeout_s) for which in ("grpo", "async")}
        meta = {"trl": trl.__version__, "tests_from": cli.tests_from or str(cli.tests), "select": cli.select}
    result, table = summarise(runs, meta)
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    cli.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    cli.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
