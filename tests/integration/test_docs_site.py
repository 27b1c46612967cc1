"""The docs site (mkdocs.yml, scripts/mkdocs_hooks.py): ``mkdocs build --strict`` passes without a warning, and fails
naming a link to a repository file that does not exist and a link to a section a page does not have."""

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 120


def build(repo: Path, site: Path) -> tuple[int, str]:
    """``mkdocs build --strict`` of ``repo``'s mkdocs.yml into ``site``: the exit status and the output."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(repo / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(site)], cwd=repo, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    return result.returncode, result.stdout + result.stderr


def problems(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]


def load_hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_without_a_warning(tmp_path):
    site = tmp_path / "site"
    status, output = build(ROOT, site)
    assert status == 0 and not problems(output), output
    home = (site / "index.html").read_text(encoding="utf-8")
    hrefs = re.findall(r'href="([^"]*)"', home)
    # README.md's links: into docs/ they become pages, to other files of the repository addresses on the forge
    assert not [h for h in hrefs if h.startswith(("docs/", "../"))], hrefs
    for href in hrefs:
        if not re.match(r"[a-z]+:|#|/", href) and href != ".":
            path = site / href.split("#")[0]
            assert path.is_file() or (path / "index.html").is_file(), f"the home page links to {href}, not built"
    trainer = (site / "reference" / "trainer" / "index.html").read_text(encoding="utf-8")
    for member in ("rollout_generate", "last_rollout_pool", "close_rollouts"):
        assert f'id="trl_async.AsyncGRPOTrainer.{member}"' in trainer, member
    assert "_generate_and_score_completions" not in trainer  # GRPOTrainer's seam, not the user's


def test_the_strict_build_fails_naming_a_missing_file_and_a_missing_anchor(tmp_path):
    """A copy of the repository (its docs, mkdocs.yml and README.md copied, the rest linked) with planted faults: a
    page's links to a repository file that does not exist, to a section another page does not have and to a section
    a repository file outside docs/ does not have, and a README.md link to a file that does not exist."""
    repo = tmp_path / "repo"
    repo.mkdir()
    copied = {"docs", "mkdocs.yml", "README.md"}
    for entry in ROOT.iterdir():
        if entry.name not in copied | {"site", ".git"}:
            (repo / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    shutil.copytree(ROOT / "docs", repo / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", repo / "mkdocs.yml")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (repo / "README.md").write_text(readme + "\nSee [the old results](benchmarks/NO_SUCH_OLD_RESULTS.md).\n")
    page = repo / "docs" / "troubleshooting.md"
    page.write_text(
        page.read_text(encoding="utf-8")
        + "\nSee [the results](../benchmarks/NO_SUCH_RESULTS.md), [the loss](usage.md#no-such-section) and [the "
        "archive](../benchmarks/ARCHIVE.md#no-such-archive-section).\n",
        encoding="utf-8",
    )
    status, output = build(repo, tmp_path / "site")
    assert status != 0, output
    found = problems(output)
    assert any(
        "docs/troubleshooting.md" in line and "'benchmarks/NO_SUCH_RESULTS.md', which is not in the repository" in line
        for line in found
    ), output
    assert any("README.md" in line and "benchmarks/NO_SUCH_OLD_RESULTS.md" in line for line in found), output
    assert any(
        "docs/troubleshooting.md" in line and "'#no-such-archive-section' that 'benchmarks/ARCHIVE.md'" in line
        for line in found
    ), output
    assert any(
        "troubleshooting.md" in line and "usage.md#no-such-section" in line and "anchor" in line for line in found
    ), output


@pytest.mark.unit
def test_links_are_found_outside_code_only():
    hooks = load_hooks()
    markdown = (
        "[a](x.md) and `[b](y.md)`, [c [nested]](z.md#part)\n"
        "```python\n[d](fenced.md)\n```\n"
        "~~~\n[e](tilde.md)\n~~~\n"
        "[ref]: ../LICENSE\n"
        '![f](<image one.png> "title") [g](https://example.com/a.md) [h](#here)\n'
    )
    seen = []
    out = hooks.rewrite_links(markdown, lambda target: seen.append(target) or f"<{target.upper()}>")
    assert seen == ["x.md", "z.md#part", "../LICENSE", "<image one.png>", "https://example.com/a.md", "#here"]
    assert out.startswith("[a](<X.MD>) and `[b](y.md)`, [c [nested]](<Z.MD#PART>)\n```python\n[d](fenced.md)")


@pytest.mark.unit
def test_links_leaving_docs_go_to_the_forge_and_missing_files_or_sections_are_errors(tmp_path, caplog):
    hooks = load_hooks()
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    for name in ("README.md", "LICENSE", "docs/usage.md", "docs/reference/trainer.md"):
        (tmp_path / name).write_text("text\n")
    (tmp_path / "notes" / "RESULTS.md").write_text(
        "# Results\n\n## Speed: what the `numbers` say\n\n## Speed: what the `numbers` say\n\n"
        '<a id="raw-id"></a>\n\n```\n# not a heading\n```\n'
    )
    config = SimpleNamespace(
        config_file_path=str(tmp_path / "mkdocs.yml"),
        docs_dir=str(tmp_path / "docs"),
        repo_url="https://forge.example/owner/repo/",
        edit_uri="edit/dev/docs/",
    )
    links = hooks.RepositoryLinks(config)
    forge = "https://forge.example/owner/repo"
    page = links.rewriter("docs/usage.md", tmp_path / "docs", "")
    assert page("../LICENSE") == f"{forge}/blob/dev/LICENSE"
    assert page("../notes/") == f"{forge}/tree/dev/notes"
    assert page("../notes/RESULTS.md#results") == f"{forge}/blob/dev/notes/RESULTS.md#results"
    for section in ("speed-what-the-numbers-say", "speed-what-the-numbers-say-1", "raw-id"):
        assert page(f"../notes/RESULTS.md#{section}") == f"{forge}/blob/dev/notes/RESULTS.md#{section}"
    assert page("../README.md#install") == "index.md#install"  # the home page: MkDocs checks the anchor
    assert page("reference/trainer.md#train") is None  # between pages: MkDocs checks it
    assert page("https://example.com/x") is None and page("#here") is None
    readme = links.rewriter("README.md", tmp_path, "")
    assert readme("docs/usage.md#faults") == "usage.md#faults"
    assert readme("<notes/RESULTS.md>") == f"<{forge}/blob/dev/notes/RESULTS.md>"
    nested = links.rewriter("docs/reference/trainer.md", tmp_path / "docs" / "reference", "reference")
    assert nested("../../README.md") == "../index.md"
    assert nested("../usage.md") is None
    with caplog.at_level(logging.ERROR, logger="mkdocs.hooks.repository_links"):
        assert page("../notes/MISSING.md") is None
        assert page("../notes/RESULTS.md#not-a-heading") is None
        assert page("../../outside.md") is None
        assert readme("docs/missing.md") is None
    assert [r.getMessage() for r in caplog.records] == [
        "docs/usage.md: the link '../notes/MISSING.md' points to 'notes/MISSING.md', which is not in the repository",
        "docs/usage.md: the link '../notes/RESULTS.md#not-a-heading' points to a section '#not-a-heading' that "
        "'notes/RESULTS.md' does not have",
        "docs/usage.md: the link '../../outside.md' leaves the repository; link to an address instead",
        "README.md: the link 'docs/missing.md' points to 'docs/missing.md', which is not in the repository",
    ]
