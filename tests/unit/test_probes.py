"""Splitting tests between the sandbox and the trainer, and reading what the harness printed, without running anything:
what goes to the sandbox, what is checked here, and that no output of a program makes the reading raise."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_async.sandbox import SandboxResult
from trl_async.sandbox.probes import Raised, Unsplittable, passes, plain_value, split_test
from trl_async.sandbox.rewards import MARK, parse_report, probe_list, read_harness

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "test, probes",
    [
        ("assert f(2) == 4", ["f(2)"]),
        ("assert repr(double_all([1, 2])) == '[2, 4]'", ["double_all([1, 2])"]),
        ("assert abs(area(2.0) - 12.566) < 1e-3", ["area(2.0)"]),
        ("assert math.isclose(area(2.0), 12.566, rel_tol=1e-3)", ["area(2.0)"]),
        ("assert is_prime(7)", ["is_prime(7)"]),
        ("assert not is_prime(8), 'eight is not prime'", ["is_prime(8)"]),
        ("assert sorted(f([3, 1])) == [1, 3] and len(g('ab')) == 2", ["f([3, 1])", "g('ab')"]),
        ("assert Solver().run([1, 2]).value == 3", ["Solver().run([1, 2]).value"]),
        ("assert f(2) == f(1) + 2", ["f(2)", "f(1)"]),
        ("assert 0 <= f(5) < 10", ["f(5)"]),
        ("assert CONSTANT == 3", ["CONSTANT"]),
        ("assert to_bin(5) == bin(5) and f(1) == math.pi", ["to_bin(5)", "f(1)"]),  # built-ins stay here
    ],
)
def test_only_calls_into_the_candidate_go_to_the_sandbox(test, probes):
    """The expected values (4, '[2, 4]', 12.566, ...) never appear in what the sandbox runs."""
    assert list(split_test(test).probes) == probes


@pytest.mark.parametrize(
    "test",
    [
        "x = f(2)\nassert x == 4",  # two statements
        "assert all(f(i) == 2 * i for i in range(3))",  # a comprehension over candidate calls
        "assert (lambda: f(1))() == 2",
        "assert f(1) == {i for i in (1, 2)}",  # a comprehension on the expected side
        "assert 'ab'.upper() == f('ab')",  # a method the trainer's side does not evaluate
        "f(2) == 4",  # not an assert
        "assert f(2) ==",  # does not parse
        "assert f(1) == print(1)",  # a built-in the program could shadow, not evaluated here
        "assert f(1) == math.factorial(5)",
    ],
)
def test_what_cannot_be_split_says_so(test):
    with pytest.raises(Unsplittable):
        split_test(test)


@pytest.mark.parametrize(
    "test, values, expected",
    [
        ("assert f(2) == 4", [4], True),
        ("assert f(2) == 4", [4.0], True),  # Python's equality: 4 == 4.0
        ("assert f(2) == 4", [5], False),
        ("assert repr(f(1)) == '[2, 4]'", [[2, 4]], True),
        ("assert repr(f(1)) == '[2, 4]'", [(2, 4)], False),  # the repr tells a tuple from a list
        ("assert abs(area(2.0) - 12.566) < 1e-3", [12.5664], True),
        ("assert abs(area(2.0) - 12.566) < 1e-3", [12.6], False),
        ("assert math.isclose(area(2.0), 12.566, rel_tol=1e-3)", [12.57], True),
        ("assert not is_prime(8)", [False], True),
        ("assert not is_prime(8)", [0], True),
        ("assert is_prime(7)", [None], False),
        ("assert f(2) == f(1) + 2", [5, 3], True),
        ("assert 0 <= f(5) < 10", [10], False),
        ("assert sorted(f([3, 1])) == [1, 3] and len(g('ab')) == 2", [[3, 1], "xy"], True),
        ("assert f(1)[1:] == 'bc'", ["bc"], True),  # the whole chain is the probe
        ("assert isinstance(f(1), int) and type(f(1)) is not bool", [1, 1], True),
        ("assert f(1) == 'a' * 3", ["aaa"], True),
        ("assert f(1) * 10**9 == 'x'", ["ab"], False),  # refused (too large to make here), so the test fails
        ("assert f(1) ** f(2) > 0", [10, 10**7], False),  # likewise
        ("assert f(1) == 3", ["3"], False),
        ("assert f(1) is None or f(1)[0] == 1", [None, Raised("TypeError")], True),  # the raise is never needed
        ("assert f(1) is None or f(1)[0] == 1", [[2], Raised("TypeError")], False),
        ("assert round(f(1), -10**18) == 0", [10**100], False),  # bounded, so refused
        ("assert sum(f(1), []) == []", [[[1]] * 100], False),
        ("assert bytes(f(1)) == b''", [10**12], False),
        ("assert list(range(f(1))) == [0, 1]", [2], True),
        ("assert list(range(f(1))) == []", [10**12], False),
        ("assert to_bin(5) == bin(5)", ["0b101"], True),
    ],
)
def test_the_check_is_evaluated_here_on_plain_values(test, values, expected):
    assert passes(split_test(test), values) is expected


def test_a_probes_repr_is_read_as_plain_data_only():
    assert plain_value("[1, (2, 'a'), {3: None}, {4}]") == [1, (2, "a"), {3: None}, {4}]
    assert plain_value("set()") == set() and plain_value("-0.5") == -0.5
    import math

    assert math.isnan(plain_value("nan")) and plain_value("-inf") == float("-inf")
    with pytest.raises(ValueError, match="longer than"):
        plain_value(repr("x" * 70_000))
    for text in ["Equal()", "<object at 0x1>", "__import__('os')", "[" * 5000, "-" * 100_000 + "1", "9" * 5000,
                 "(" * 300 + ")" * 300, "1 if True else 2", "f(1)"]:  # fmt: skip
        with pytest.raises(ValueError):
            plain_value(text)


def test_tests_that_cannot_be_split_run_whole_when_allowed():
    from trl_async.sandbox.probes import SplitTest

    tests = [split_test("assert f(1) == 2"), SplitTest(source="x = f(1)\nassert x == 2", probes=(), check=None)]
    assert probe_list(tests) == [["value", "f(1)"], ["exec", "x = f(1)\nassert x == 2"]]


RUN = dict(exit_code=0, signal=None, stderr="", seconds=0.1, isolation="namespaces")
TESTS = [split_test("assert f(2) == 4"), split_test("assert g(1) == 'x'")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)
records = st.one_of(
    st.builds(lambda v: MARK + json.dumps(v), json_values),
    st.builds(lambda i, k, v: MARK + json.dumps({"probe": i, k: v}), st.integers(-2, 3),
              st.sampled_from(["value", "raised", "passed", "other"]), json_values),
    st.builds(lambda o: MARK + json.dumps({"outcome": o}), st.sampled_from(["ran", "crashed", "syntax_error", "x"])),
    st.builds(lambda n: MARK + "[" * n, st.integers(0, 100_000)),
    st.text(),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(records, max_size=12), limits=st.lists(st.sampled_from(["wall_time", "output"]), max_size=1))
def test_no_output_of_a_program_makes_the_report_raise(lines, limits):
    result = SandboxResult(stdout="\n".join(lines), limits=tuple(limits), **RUN)
    report = parse_report(result, TESTS)
    assert report["outcome"] in ("ran", "crashed", "syntax_error", "stopped")
    if report["outcome"] == "ran":
        assert 0 <= report["passed"] <= 2 and report["total"] == 2
    read_harness(result.stdout, 2)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=2000))
def test_no_repr_makes_reading_it_raise_anything_but_value_error(text):
    try:
        plain_value(text)
    except ValueError:
        pass


@given(value=json_values)
def test_a_value_passes_only_if_it_equals_the_expected(value):
    """Whatever plain value a probe returns, ``assert f(2) == 4`` passes exactly when it equals 4."""
    answers = f"\n{MARK}{json.dumps({'probe': 0, 'value': repr(value)})}\n{MARK}{json.dumps({'outcome': 'ran'})}\n"
    report = parse_report(SandboxResult(stdout=answers, limits=(), **RUN), TESTS[:1])
    assert report["passed"] == (value == 4)
