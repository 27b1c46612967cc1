"""Setting attributes for the length of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def swapped(obj, **values) -> Iterator[None]:
    """Give ``obj`` these attribute values inside the block, and back the ones it had after it, whatever happens."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)
