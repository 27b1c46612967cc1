"""The code-execution reward and the code task: generated code runs in the sandbox against the row's tests."""

import json

import pytest
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer
from trl_async.demo.code_task import HELDOUT_FUNCTIONS, TRAIN_FUNCTIONS, make_split
from trl_async.sandbox import Limits, SandboxResult
from trl_async.sandbox.probes import split_test
from trl_async.sandbox.rewards import MARK, CodeExecutionReward, extract_code, parse_report, score, tool_text

from ..conftest import COMMON, async_args

TESTS = ["assert f(2) == 4", "assert f(3) == 6", "assert f(0) == 1"]


def fenced(code: str, lang: str = "python") -> str:
    return f"Here you go:\n```{lang}\n{code}\n```\nDone."


@pytest.mark.unit
def test_the_last_fenced_block_is_the_code():
    assert extract_code(fenced("x = 1")) == "x = 1\n"
    assert extract_code(fenced("a", "py") + fenced("b", "")) == "b\n"
    assert extract_code("def f(x): return x") is None  # no fence: no code
    assert extract_code("```python\nunterminated") is None


def record(**fields) -> str:
    return "\n" + MARK + json.dumps(fields) + "\n"


@pytest.mark.unit
def test_a_report_counts_the_tests_whose_probes_returned_values_that_satisfy_them():
    run = dict(exit_code=0, signal=None, stderr="", seconds=0.1, isolation="namespaces")
    tests = [split_test(t) for t in TESTS]  # one probe each: f(2), f(3), f(0)
    answers = record(probe=0, value="4") + record(probe=1, value="7") + record(probe=2, value="1")
    result = SandboxResult(stdout="noise" + answers + record(outcome="ran"), limits=(), **run)
    assert parse_report(result, tests) == {"outcome": "ran", "passed": 2, "total": 3}  # 4 == 4, 7 != 6, 1 == 1
    no_end = SandboxResult(stdout=answers, limits=(), **run)  # the program ended the harness before it finished
    assert parse_report(no_end, tests)["outcome"] == "crashed"
    stopped = SandboxResult(stdout=answers + record(outcome="ran"), limits=("wall_time",), **run)
    assert parse_report(stopped, tests)["outcome"] == "stopped"
    # what the program can print itself is data: values (checked here), never a verdict
    claims = record(outcome="ran") + record(probe=0, passed=True) + record(probe=1, value=repr(object()))
    claims += record(probe=2, raised="AssertionError") + record(probe=9, value="4") + record(probe="0", value="4")
    assert parse_report(SandboxResult(stdout=claims, limits=(), **run), tests)["passed"] == 0
    assert score({"outcome": "ran", "passed": 1, "total": 4}) == 0.25
    assert score({"outcome": "syntax_error"}) == score({"outcome": "ran", "passed": 0, "total": 0}) == 0.0


@pytest.mark.unit
def test_the_tool_shows_output_and_how_a_failed_run_ended():
    run = dict(signal=None, seconds=0.1, isolation="namespaces")
    assert tool_text(SandboxResult(exit_code=0, stdout="12\n", stderr="", limits=(), **run), 100) == "12\n"
    failed = SandboxResult(exit_code=1, stdout="", stderr="ZeroDivisionError", limits=(), **run)
    assert tool_text(failed, 100) == "ZeroDivisionError\n[exit status 1]"
    flood = SandboxResult(exit_code=None, stdout="x" * 500, stderr="", limits=("output",), **run)
    assert tool_text(flood, 100).endswith("[output cut]") and len(tool_text(flood, 100)) == 93


@pytest.mark.unit
def test_code_task_splits_are_disjoint_and_reproducible():
    assert not {f.name for f in TRAIN_FUNCTIONS} & {f.name for f in HELDOUT_FUNCTIONS}
    a, b = make_split("train", 16, seed=3), make_split("train", 16, seed=3)
    assert a["tests"] == b["tests"] and len(a["tests"][0]) == 4
    heldout = make_split("heldout", len(HELDOUT_FUNCTIONS))
    assert all(f"`{f.name}(" in heldout[i]["prompt"][-1]["content"] for i, f in enumerate(HELDOUT_FUNCTIONS))
    with pytest.raises(ValueError, match="split must be"):
        make_split("test", 1)


def test_the_reward_is_the_fraction_of_tests_passed_and_failures_are_counted():
    reward = CodeExecutionReward(limits=Limits(wall_s=3, cpu_s=2))
    completions = [
        fenced("def f(x):\n    return 2 * x"),  # 2 of 3 (f(0) == 0, not 1)
        "def f(x): return 2 * x",  # no fenced block
        fenced("def f(x)\n    return 1"),  # does not compile
        fenced("raise SystemExit(0)"),  # ends before the tests: no report
        fenced("while True:\n    pass"),  # stopped by the CPU limit
        fenced("print('noise')\ndef f(x):\n    return 1 if x == 0 else 2 * x"),  # 3 of 3
        [{"role": "assistant", "content": fenced("def f(x):\n    return 1")}],  # conversational: 1 of 3
        [{"role": "assistant", "content": None}],  # no content: no code
        # forgeries, each scoring 0: replacing builtins.exec and builtins.repr (the verdict is not computed here),
        # calling a report function (there is none), printing the harness's records claiming a pass (only values
        # count, and these are wrong), an object equal to everything (its repr is not plain data)
        fenced("import builtins\nbuiltins.exec = builtins.eval = lambda *a, **k: None\nbuiltins.repr = lambda o: '4'"),
        fenced("import __main__\n__main__.report(outcome='ran', passed=1000, total=1)"),
        fenced(
            f"import json, os\nfor i in range(3):\n    print({MARK!r} + json.dumps({{'probe': i, 'passed': True}}))\n"
            f"print({MARK!r} + json.dumps({{'outcome': 'ran'}}), flush=True)\nos._exit(0)"
        ),
        fenced("class Equal:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Equal()"),
    ]
    metrics = {}
    rewards = reward(completions, tests=[TESTS] * 12, log_metric=metrics.__setitem__)
    assert rewards == pytest.approx([2 / 3, 0, 0, 0, 0, 1, 1 / 3, 0, 0, 0, 0, 0])
    assert metrics == pytest.approx({"code_execution/no_code": 2 / 12, "code_execution/syntax_error": 1 / 12,
                                     "code_execution/crashed": 2 / 12, "code_execution/stopped": 1 / 12,
                                     "code_execution/passed_all": 1 / 12})  # fmt: skip
    with pytest.raises(ValueError, match="needs a 'tests' column"):
        reward(completions[:1], answer=["1"])


def test_every_reference_solution_passes_its_own_tests_and_a_wrong_one_fails_them():
    reward = CodeExecutionReward()
    functions = TRAIN_FUNCTIONS + HELDOUT_FUNCTIONS
    problems = [row for split, n in (("train", len(TRAIN_FUNCTIONS)), ("heldout", len(HELDOUT_FUNCTIONS)))
                for row in make_split(split, n, seed=1)]  # fmt: skip
    tests = [p["tests"] for p in problems]
    assert reward([fenced(fn.solution) for fn in functions], tests=tests) == [1.0] * len(functions)
    assert reward([fenced(f"def {fn.name}({fn.params}):\n    return None") for fn in functions], tests=tests) == [
        0.0
    ] * len(functions)
    assert make_split("train", 1, seed=0)["tests"][0][0].startswith("assert repr(double_all([")


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, AsyncGRPOTrainer])
def test_both_trainers_train_with_the_code_reward(tmp_path, tiny_model_dir, trainer_class):
    """A plain reward function to either trainer: the tiny model writes no code, so every completion scores 0 and
    is logged as ``no_code``."""
    dataset = make_split("train", 8)
    dataset = dataset.map(lambda row: {"prompt": row["prompt"][-1]["content"]})  # the tiny model has no chat template
    settings = {**COMMON, "max_steps": 2, "output_dir": str(tmp_path)}
    args = GRPOConfig(**settings) if trainer_class is GRPOTrainer else async_args(tmp_path, max_steps=2)
    trainer = trainer_class(model=tiny_model_dir, reward_funcs=CodeExecutionReward(), args=args, train_dataset=dataset)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "code_execution/no_code" in h]
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert all(h["code_execution/no_code"] == 1.0 and h["rewards/code_execution/mean"] == 0.0 for h in logged)
    json.dumps(trainer.state.log_history)
