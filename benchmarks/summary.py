"""The results table of README.md and docs/benchmarks.md, built from ``benchmarks/results/*.json``.

Every number in the table is read from a results file, and every row names what it is compared with, on which
machine, with which model, and over how many seeds or repeats. ``python benchmarks/summary.py`` rewrites the tables
between the ``<!-- results-table:begin -->`` and ``<!-- results-table:end -->`` markers; ``--check`` exits 1 when a
committed table differs from what the results say (the test suite runs the same check)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
PINNED = "the synchronous schedule, one core per phase¹"
REAL_MODEL = "SmolLM2-135M-Instruct²"
TINY_MODEL = "a tiny local model³"
FASTEST_GRPO = "TRL `GRPOTrainer`, the fastest of 1 thread, 2 threads and 2-process DDP"  # in each measure
FOOTNOTES = (
    "¹ AsyncGRPOTrainer at `max_staleness=0` with generation pinned to one core and training to the other: what "
    "a synchronous trainer does with a generation device of its own. On a CPU the pinned split is slower than TRL's "
    "`GRPOTrainer` using both cores for both phases (see the row that measures both), so on a CPU these rows measure "
    "the overlap, not a way to train faster than GRPOTrainer.\n\n"
    "² The Q4_1 GGUF checkpoint of SmolLM2-135M-Instruct, dequantized to float32 (the `[demo]` extra), on "
    "arithmetic word problems.\n\n"
    "³ Built in the benchmark from random weights: these rows measure the machinery (queue, scoring, tools), not "
    "learning.\n\n"
    "The bound is (G+T)/max(G,T) from the synchronous run's generation (G) and training (T) phases: what overlap can "
    "give when each phase has a device of its own. Tokens/s counts the prompt and completion tokens trained on the "
    'SmolLM2 rows, the completion tokens sampled on the tiny-model rows; "equal work" means both sides train '
    "the same number of tokens per step. η is `max_staleness`."
)


@dataclass(frozen=True)
class Row:
    setting: str
    machine: str
    result: str
    baseline: str
    bound: str
    learning: str
    seeds: str
    source: str  # a results file name, without .json
    front: bool  # also on the README's front page


def cpu_label(machine: dict) -> str:
    """The CPU a run recorded, said the way the tables say it (results written before the CPU was recorded were all
    measured on the Intel Xeon with AMX: ``report.measured_on`` says the same)."""
    cores = machine.get("cpu_count", 2)
    cpu = machine.get("cpu")
    if cpu is None:
        return f"{cores}-core Intel Xeon (AMX)"
    kind = "AMD EPYC" if "EPYC" in cpu else "Intel Xeon" if "Xeon" in cpu else cpu
    if machine.get("native_bf16"):
        return f"{cores}-core {kind} ({'AMX' if kind == 'Intel Xeon' else 'AVX512-BF16'})"
    return f"{cores}-core {kind} (no native bf16: float32)"


def x(value: float) -> str:
    return f"{value:.2f}×"


def by_config(rows: list[dict]) -> dict[str, dict]:
    return {r["config"]: r for r in rows}


def completion_tokens_per_step(runs: list[dict], config: str) -> float:
    return statistics.mean(r["completion_tokens"] / len(r["step_s"]) for r in runs if r["config"] == config)


def seeds(meta: dict) -> str:
    return str(len(meta["seeds"]))


def shared_real(d: dict) -> Row:
    c = by_config(d["rows"])
    a, s = c["async"], c["sync"]
    return Row(
        "generation and training share the cores",
        f"{cpu_label(d['machine'])}, {REAL_MODEL}, 32-token completions, lr {d['meta']['task']['learning_rate']:g}",
        f"{x(a['tokens_per_s_vs_sync'])} tokens/s, {x(a['steps_per_min_vs_sync'])} steps/min (max_staleness 1)",
        "TRL `GRPOTrainer`, 2 threads", "-",
        f"held-out accuracy after {d['meta']['steps']} steps {a['accuracy']['final']:.2f} "
        f"(sd {a['accuracy']['sd']:.2f}) against {s['accuracy']['final']:.2f} (sd {s['accuracy']['sd']:.2f})",
        seeds(d["meta"]), "time_to_accuracy", True)  # fmt: skip


def shared_and_pinned(d: dict) -> Row:
    c = by_config(d["rows"])
    grpo, a, pinned = c["sync"], c["async"], c["ded_async_s1"]
    per = lambda r: r["tokens_per_s_vs_sync"] / grpo["tokens_per_s_vs_sync"]  # noqa: E731
    return Row(
        "the same cores: GRPOTrainer, async, and async with a core per phase",
        f"{cpu_label(d['machine'])}, {REAL_MODEL}, {d['meta']['max_completion_length']}-token completions",
        f"{x(per(a))} tokens/s; pinned one core per phase: {x(per(pinned))}",
        "TRL `GRPOTrainer`, 2 threads", "-", "-", seeds(d["meta"]), "dedicated_32_shared", True)  # fmt: skip


def pinned(d: dict, setting: str, config: str = "ded_async_s1", front: bool = False) -> Row:
    c, meta = by_config(d["rows"]), d["meta"]
    r = c[config]
    if meta.get("fixed_length"):
        work = "equal work"
    else:
        work = (f"unequal work: {completion_tokens_per_step(d['runs'], config):.0f} against "
                f"{completion_tokens_per_step(d['runs'], 'ded_sync'):.0f} completion tokens per step")  # fmt: skip
    learning = "-"
    if r["accuracy"]["tta_vs_sync"] is not None:
        learning = (f"reached the synchronous run's final held-out accuracy in {x(r['accuracy']['tta_vs_sync'])} its "
                    f"time ({r['accuracy']['final']:.2f} against {c['ded_sync']['accuracy']['final']:.2f} at the end)")  # fmt: skip
    staleness = config.rsplit("_s", 1)[-1]
    return Row(
        setting,
        f"{cpu_label(d['machine'])}, {REAL_MODEL}, {meta['max_completion_length']}-token completions, {work}",
        f"{x(r['tokens_per_s_vs_sync'])} tokens/s (max_staleness {staleness})", PINNED,
        f"{meta['phases']['bound']:.2f}", learning, seeds(meta), d["_name"], front)  # fmt: skip


def throughput(d: dict, regime: str, config: str, setting: str, extra: Callable[[list[dict]], str] = lambda _: "",
               front: bool = False) -> Row:  # fmt: skip
    rows = [r for r in d["summary"] if r["regime"] == regime]
    r = next(r for r in rows if r["config"] == config)
    result = f"{x(r['tokens_vs_best_sync'])} tokens/s, {x(r['speedup_vs_best_sync'])} steps/s ({config})"
    return Row(setting, f"{cpu_label(d['machine'])}, {TINY_MODEL}", result + extra(rows), FASTEST_GRPO,
               "-", "-", f"{r['repeats']} repeats", "throughput", front)  # fmt: skip


def long_tail_static(rows: list[dict]) -> str:
    r = next(r for r in rows if r["config"] == "async η=2")
    return f"; static batches: {x(r['tokens_vs_best_sync'])}, {x(r['speedup_vs_best_sync'])}"


def agentic(d: dict) -> Row:
    rows = by_config(d["summary"])
    best = max((r for r in d["summary"] if r["config"].startswith("sync")), key=lambda r: r["tokens_vs_best_sync"])
    asyncs = [r for r in d["summary"] if r["config"] in ("async η=2", "async η=4", "async η=8")]
    result = ", ".join(f"{x(r['tokens_vs_best_sync'])} ({r['config'].removeprefix('async ')})" for r in asyncs)
    lengths = ", ".join(f"{r['trained_mean_length']:.1f}" for r in asyncs)
    return Row(
        "multi-turn episodes with a slow tool",
        f"{cpu_label(d['machine'])}, {TINY_MODEL}",
        f"{result} tokens/s; trained episodes shorten as η grows (mean length {lengths} against "
        f"{rows[best['config']]['trained_mean_length']:.1f})",
        FASTEST_GRPO, "-", "-",
        str(best["seeds"]), "agentic", True)  # fmt: skip


def vllm_shared(d: dict) -> Row:
    r = by_config(d["rows"])["async_vllm"]
    return Row(
        "a vLLM CPU server on the trainer's cores",
        f"{cpu_label(d['machine'])}, {REAL_MODEL}, 32-token completions",
        f"{x(r['tokens_per_s_vs_sync'])} tokens/s, {x(r['steps_per_min_vs_sync'])} steps/min (max_staleness 1)",
        "TRL `GRPOTrainer`, 2 threads", "-", "-", seeds(d["meta"]), "vllm_real", False)  # fmt: skip


def sandbox(d: dict) -> Row:
    slow = max(d["settings"]["test_ms"])
    runs = [r for r in d["runs"] if r["test_ms"] == slow and r["reward"] == "sandboxed"]
    grpo = max((r for r in runs if r["kind"] == "sync"), key=lambda r: r["tokens_per_s"])
    a = next(r for r in runs if r["kind"] == "async" and r["staleness"] == 1)
    return Row(
        f"code rewards in the sandbox, tests taking {slow} ms",
        f"{cpu_label(d['machine'])}, {TINY_MODEL}",
        f"{x(a['tokens_per_s'] / grpo['tokens_per_s'])} tokens/s (max_staleness 1)",
        f"TRL `GRPOTrainer` with the same reward, {grpo['threads']} threads", "-", "-", "1", "sandbox_reward", False)  # fmt: skip


def build(results: dict[str, dict]) -> list[Row]:
    """The table's rows from the loaded results (name -> JSON), in the order they are shown."""
    t = results["throughput"]
    return [
        shared_real(results["time_to_accuracy"]),
        shared_and_pinned(results["dedicated_32_shared"]),
        pinned(results["dedicated_128_tta"], "generation on a core of its own", front=True),
        pinned(results["dedicated_128_worker"], "the same, equal work (every completion 128 tokens)", front=True),
        pinned(results["dedicated_128_epyc"], "a vLLM CPU server on a core of its own", config="ded_vllm_s1"),
        throughput(
            t,
            "long_tail",
            "async η=2, continuous",
            "long-tailed lengths, continuous batching, learning rate 0 (every run samples the same lengths)",
            long_tail_static,
            front=True,
        ),  # fmt: skip
        throughput(t, "gen_bound", "async η=1, continuous", "generation-bound: every completion 128 tokens"),
        throughput(t, "slow_reward", "async η=1, 4 scorers", "a slow verifier (20 ms a completion)", front=True),
        agentic(results["agentic"]),
        sandbox(results["sandbox_reward"]),
        vllm_shared(results["vllm_real"]),
    ]


HEADER = ["setting", "machine, model, work", "async", "against (1.00×)", "bound", "learning", "seeds", "data"]


def render(rows: list[Row], results_link: str) -> str:
    """The Markdown table; ``results_link`` is the path from the page to ``benchmarks/results``."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = [r.setting, r.machine, r.result, r.baseline, r.bound, r.learning, r.seeds,
                 f"[{r.source}]({results_link}/{r.source}.json)"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + FOOTNOTES


def splice(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table`` (a page without the markers is an error)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the page has no {BEGIN} ... {END} block")
    block = f"{BEGIN}\n{table}\n{END}"
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, count=1, flags=re.S)


def load(results_dir: Path = RESULTS) -> dict[str, dict]:
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        out[path.stem] = {**json.loads(path.read_text()), "_name": path.stem}
    return out


PAGES = {"README.md": ("benchmarks/results", True), "docs/benchmarks.md": ("../benchmarks/results", False)}


def expected(root: Path = ROOT, results_dir: Path = RESULTS) -> dict[str, str]:
    """Each page's text as it should be, with its table rebuilt from the results."""
    rows = build(load(results_dir))
    out = {}
    for page, (link, front_only) in PAGES.items():
        shown = [r for r in rows if r.front or not front_only]
        out[page] = splice((root / page).read_text(), render(shown, link))
    return out


def stale(root: Path = ROOT, results_dir: Path = RESULTS) -> dict[str, str]:
    """The pages whose committed table differs from what the results say: page -> its text as it should be."""
    return {page: text for page, text in expected(root, results_dir).items() if (root / page).read_text() != text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed table differs from the results")
    cli = parser.parse_args(argv)
    pages = stale()
    if cli.check and pages:
        print(f"out of date with benchmarks/results: {', '.join(pages)}; run python benchmarks/summary.py")
        return 1
    for page, text in pages.items():
        (ROOT / page).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
