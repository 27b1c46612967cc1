"""Which FSDP version a run asks for, from the training arguments or from `accelerate launch`'s environment, worked
out as transformers and accelerate set them: FSDP2 is served, FSDP1 refused with the fix."""

from types import SimpleNamespace

import pytest

from trl_async.setup.checks import FSDP1, fsdp_version, unsupported_setup

pytestmark = pytest.mark.unit


def test_the_version_comes_from_the_arguments_or_from_accelerate_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    assert fsdp_version(SimpleNamespace(fsdp="")) is None and fsdp_version(None) is None
    assert fsdp_version(SimpleNamespace(fsdp="full_shard", fsdp_config=None)) == 2  # transformers' default
    assert fsdp_version(SimpleNamespace(fsdp="full_shard", fsdp_config={"version": 1})) == 1
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert fsdp_version(None) == 1  # accelerate sets FSDP_VERSION from the config, 1 where it names none
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp_version(None) == 2


def test_fsdp1_is_refused_and_fsdp2_is_not(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert unsupported_setup("model-id", None, None) == FSDP1
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert unsupported_setup("model-id", None, None) is None
