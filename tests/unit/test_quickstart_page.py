"""The quick-start page shows each script exactly as it is in `examples/`, the README's commands are the page's, and
the GPU commands' flags parse into the config the script builds."""

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
FENCE = re.compile(r"^ *```(\w+)\n(.*?)^ *```$", re.S | re.M)


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def commands(text: str) -> list[str]:
    """Each shell command of the text's bash blocks, continuation lines joined, spaces normalised."""
    joined = [body.replace("\\\n", " ") for body in blocks(text, "bash")]
    return [" ".join(line.split()) for body in joined for line in body.splitlines() if line.strip()]


@pytest.mark.parametrize("script", ["quickstart_cpu.py", "quickstart_gpu.py"])
def test_the_page_shows_the_script_as_it_is(script):
    assert (ROOT / "examples" / script).read_text() in blocks(PAGE.read_text(), "python")


def test_the_readme_quick_start_commands_are_the_pages():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    shown = commands(section)
    assert len(shown) >= 6 and set(shown) <= set(commands(PAGE.read_text()))


def test_the_fences_are_found():
    """The parser above sees every fenced block of the page (a planted fence would otherwise hide a script)."""
    assert len(blocks(PAGE.read_text(), "python")) == 2
    assert "python examples/quickstart_cpu.py" in commands(PAGE.read_text())


def test_the_gpu_commands_parse_into_the_scripts_config(monkeypatch):
    from trl import TrlParser

    from trl_async import AsyncGRPOConfig

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import quickstart_gpu

    launches = [c for c in commands(PAGE.read_text()) if "examples/quickstart_gpu.py" in c]
    served = [c for c in commands(PAGE.read_text()) if " trl vllm-serve " in f" {c} "]
    assert len(launches) == 2 and len(served) == 1
    assert shlex.split(served[0])[shlex.split(served[0]).index("--model") + 1] == quickstart_gpu.MODEL
    modes = set()
    for launch in launches:
        argv = shlex.split(launch.split("examples/quickstart_gpu.py", 1)[1]) + ["--bf16", "False"]  # no GPU here
        parser = TrlParser(AsyncGRPOConfig)
        parser.set_defaults(**quickstart_gpu.DEFAULTS)
        monkeypatch.setattr(sys, "argv", ["quickstart_gpu.py", *argv])
        (args,) = parser.parse_args_and_config()
        assert args.use_vllm and args.max_staleness == 1
        modes.add(args.vllm_mode)
    assert modes == {"colocate", "server"}
