"""Tests that a candidate program cannot forge: each ``assert`` is split between the sandbox and the trainer.

In ``assert EXPR``, every call into the candidate's code (a call, attribute or subscript chain rooted at a name the
test does not know, such as ``f(2)`` or ``Solver().run([1, 2])``, arguments included: the test's inputs) is a
*probe*. Probes run in the sandbox, in the candidate's process, and each comes back as plain data: its ``repr``,
read here with ``ast.literal_eval``. The rest of the expression (the expected values, the comparisons, and pure
built-ins such as ``repr``, ``sorted``, ``len``, ``abs`` or ``math.isclose`` applied to the probes' values) is
evaluated here, in the trainer, by ``evaluate``, which knows only plain data and a short list of functions.

So the candidate's process never holds an expected value, and nothing it does (an object whose ``__eq__`` always
answers True, a redefined ``repr``, a patched ``assert``, a report printed early, the harness's frames) takes part in
the verdict: a test passes exactly when the values the candidate's calls returned satisfy it. A test that cannot be
split this way (several statements, a comprehension over candidate calls, a helper the test defines) is
``Unsplittable``; the reward refuses it, or runs it whole in the candidate's process when told to, where it can be
forged.
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
import operator
from dataclasses import dataclass

MAX_ITEMS = 1_000_000  # the most items a trainer-side product may make (``[0] * n``, ``"ab" * n``)
MAX_VALUE_CHARS = 1 << 16  # the longest repr of a probe's value read back: larger values fail their test
MAX_POWER_BITS = 1_000_000  # the largest integer ``**`` may make here, in bits


def _bounded_int(n, what: str, bound: int = MAX_ITEMS) -> None:
    if isinstance(n, int) and abs(n) > bound:
        raise ValueError(f"{what} too large to evaluate")


def _round(number, ndigits=None):
    _bounded_int(ndigits, "round's ndigits", 10_000)  # round(10**4000, -10**18) would compute 10**(10**18)
    return round(number) if ndigits is None else round(number, ndigits)


def _bytes(*args):
    if args and isinstance(args[0], int):
        _bounded_int(args[0], "bytes(n)")
    return bytes(*args)


def _sum(values, start=0):
    if not isinstance(start, (int, float, complex)):  # sum(lists, []) is quadratic in what the program returned
        raise ValueError("sum with a non-number start is not evaluated on the trainer's side")
    return sum(values, start)


def _pow(base, exponent, modulus=None):
    if modulus is None:
        return binary(ast.Pow(), base, exponent)
    return pow(base, exponent, modulus)


def _range(*args):
    result = range(*args)
    _bounded_int(len(result), "range")
    return result


def _type(value):
    return type(value)


# what a test may call or name on the trainer's side: pure, bounded in time and memory on plain data
FUNCTIONS = {
    **{f.__name__: f for f in (abs, all, any, ascii, bin, bool, chr, complex, dict, divmod, enumerate, float, frozenset,
                               hex, int, isinstance, len, list, max, min, oct, ord, repr, reversed, set, sorted, str,
                               tuple, zip)},
    "round": _round, "bytes": _bytes, "sum": _sum, "pow": _pow, "range": _range, "type": _type,
}  # fmt: skip
MATH = {name: getattr(math, name) for name in ("isclose", "isnan", "isinf", "isfinite", "floor", "ceil", "fabs",
                                               "sqrt", "trunc", "exp", "log", "log2", "log10", "copysign")}  # fmt: skip
MATH_VALUES = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}
# built-in names the trainer does not evaluate: a probe rooted at one would let the program shadow an expected value
BUILTINS = set(dir(builtins))
SAFE_NAMES = {*FUNCTIONS, "math"}
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


@dataclass(frozen=True)
class Raised:
    """A probe that raised: a check that needs its value fails; one that does not (``f(x) is None or ...``) may
    still pass."""

    name: str


class Unsplittable(ValueError):
    """The test is not one ``assert`` whose candidate calls can be separated from the rest."""


@dataclass(frozen=True)
class SplitTest:
    """One test: ``probes`` (candidate calls, as source) run in the sandbox; ``check`` (the assert's expression,
    each probe replaced by the name ``__probe_<i>``) is evaluated here on their values."""

    source: str
    probes: tuple[str, ...]
    check: ast.expr | None  # None: an unsplittable test run whole in the candidate's process (forgeable)


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def candidate_rooted(node: ast.AST) -> bool:
    """Whether ``node`` is a chain of calls, attributes and subscripts that starts at a name the test does not know
    (the candidate's function, class or variable)."""
    root = _root(node)
    return root is not None and root not in SAFE_NAMES


@functools.lru_cache(maxsize=1 << 16)
def split_test(source: str) -> SplitTest:
    """Split ``source`` (one ``assert`` statement); raises ``Unsplittable`` saying why not."""
    try:
        body = ast.parse(source).body
    except SyntaxError as exc:
        raise Unsplittable(f"it does not parse ({exc.msg})") from exc
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise Unsplittable("it is not a single assert statement")
    probes: list[str] = []
    check = _replace_probes(body[0].test, probes)
    return SplitTest(source=source, probes=tuple(probes), check=check)


def _replace_probes(node: ast.AST, probes: list[str]) -> ast.AST:
    if isinstance(node, ast.expr) and candidate_rooted(node):
        if _root(node) in BUILTINS:
            raise Unsplittable(f"`{ast.unparse(node)}` calls a built-in the trainer's side does not evaluate, which "
                               "the program could shadow")  # fmt: skip
        probes.append(ast.unparse(node))
        return ast.Name(id=f"__probe_{len(probes) - 1}", ctx=ast.Load())
    if isinstance(node, ast.Attribute):
        if not (isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in {*MATH, *MATH_VALUES}):
            raise Unsplittable(f"`{ast.unparse(node)}` is computed on the trainer's side, which knows only math.*")
        return node
    if not isinstance(node, SUPPORTED):
        raise Unsplittable(
            f"`{ast.unparse(node)}` ({type(node).__name__}) cannot be evaluated apart from the candidate"
        )
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            setattr(node, name, _replace_probes(value, probes))
        elif isinstance(value, list):
            setattr(node, name, [_replace_probes(v, probes) if isinstance(v, ast.AST) else v for v in value])
    return node


SUPPORTED = (
    ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Name, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare,
    ast.Call, ast.keyword, ast.Subscript, ast.Slice, ast.IfExp, ast.expr_context, ast.operator, ast.unaryop,
    ast.boolop, ast.cmpop,
)  # fmt: skip


def plain_value(text: str):
    """A probe's ``repr`` read back as plain data (numbers, strings, bytes, None, and lists, tuples, sets and dicts of
    them); raises ``ValueError`` for anything else, however malformed or deep."""
    if len(text) > MAX_VALUE_CHARS:  # reading is quadratic in the worst case (colliding hashes in a set)
        raise ValueError(f"longer than {MAX_VALUE_CHARS} characters")
    if text in ("nan", "inf", "-inf"):
        return float(text)
    try:
        return ast.literal_eval(text)
    except Exception as exc:  # SyntaxError, RecursionError, MemoryError, the int-digits limit
        raise ValueError(f"not plain data: {type(exc).__name__}") from exc


def passes(test: SplitTest, values: list) -> bool:
    """Whether the test holds for its probes' ``values`` (plain data); any failure to evaluate is a fail."""
    try:
        return bool(evaluate(test.check, {f"__probe_{i}": v for i, v in enumerate(values)}))
    except Exception:  # a wrong type, an overflow, a bound below: the candidate's values fail the test
        return False


def evaluate(node: ast.AST, names: dict):
    """The trainer-side value of ``node``, over the probes' values (``names``) and ``FUNCTIONS``/``MATH`` only."""
    match node:
        case ast.Constant(value=value):
            return value
        case ast.Name(id=name):
            value = names[name] if name in names else FUNCTIONS[name]
            if isinstance(value, Raised):
                raise ValueError(f"the probe raised {value.name}")  # only if the check needs it (``or``, ``if``)
            return value
        case ast.Attribute(value=ast.Name(id="math"), attr=attr) if attr in MATH_VALUES:
            return MATH_VALUES[attr]
        case ast.List(elts=elts):
            return [evaluate(e, names) for e in elts]
        case ast.Tuple(elts=elts):
            return tuple(evaluate(e, names) for e in elts)
        case ast.Set(elts=elts):
            return {evaluate(e, names) for e in elts}
        case ast.Dict(keys=keys, values=values):
            return {evaluate(k, names): evaluate(v, names) for k, v in zip(keys, values, strict=True)}
        case ast.UnaryOp(op=op, operand=operand):
            return UNARY[type(op)](evaluate(operand, names))
        case ast.BinOp(left=left, op=op, right=right):
            return binary(op, evaluate(left, names), evaluate(right, names))
        case ast.BoolOp(op=ast.And(), values=values):
            result = True
            for v in values:
                result = evaluate(v, names)
                if not result:
                    return result
            return result
        case ast.BoolOp(op=ast.Or(), values=values):
            result = False
            for v in values:
                result = evaluate(v, names)
                if result:
                    return result
            return result
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            a = evaluate(left, names)
            for op, right in zip(ops, comparators, strict=True):
                b = evaluate(right, names)
                if not COMPARE[type(op)](a, b):
                    return False
                a = b
            return True
        case ast.IfExp(test=test, body=body, orelse=orelse):
            return evaluate(body if evaluate(test, names) else orelse, names)
        case ast.Subscript(value=value, slice=index):
            return evaluate(value, names)[evaluate(index, names)]
        case ast.Slice(lower=lower, upper=upper, step=step):
            return slice(*(None if p is None else evaluate(p, names) for p in (lower, upper, step)))
        case ast.Call(func=func, args=args, keywords=keywords):
            function = MATH[func.attr] if isinstance(func, ast.Attribute) else FUNCTIONS[func.id]
            return function(*(evaluate(a, names) for a in args), **{k.arg: evaluate(k.value, names) for k in keywords})
    raise ValueError(f"cannot evaluate {type(node).__name__}")


def binary(op: ast.operator, a, b):
    """``a op b`` on plain data, refusing what could exhaust the trainer (huge repetitions and powers)."""
    numbers = (int, float, complex)
    if isinstance(op, ast.Mult):
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                raise ValueError("a repetition too large to evaluate")
        return a * b
    if isinstance(op, ast.Pow):
        if isinstance(a, int) and isinstance(b, int) and abs(a).bit_length() * abs(b) > MAX_POWER_BITS:
            raise ValueError("a power too large to evaluate")
        return a**b
    if isinstance(op, (ast.Add, ast.Sub)):
        return a + b if isinstance(op, ast.Add) else a - b
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and isinstance(a, numbers) and isinstance(b, numbers):
        return a / b if isinstance(op, ast.Div) else a // b if isinstance(op, ast.FloorDiv) else a % b
    raise ValueError(f"{type(op).__name__} is not evaluated on the trainer's side")
