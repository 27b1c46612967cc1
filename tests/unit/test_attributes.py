from types import SimpleNamespace

import pytest

from trl_async.correction.attributes import swapped


def test_swapped_restores_what_was_there_even_when_the_block_raises():
    obj = SimpleNamespace(a=1, b="x")
    with swapped(obj, a=2, b=None):
        assert (obj.a, obj.b) == (2, None)
    assert (obj.a, obj.b) == (1, "x")
    with pytest.raises(RuntimeError), swapped(obj, a=3):
        assert obj.a == 3
        raise RuntimeError
    assert obj.a == 1
