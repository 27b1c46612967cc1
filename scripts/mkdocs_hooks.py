"""MkDocs hooks (``hooks:`` in mkdocs.yml): the home page comes from README.md, and links that leave ``docs/`` point
at the repository on the forge.

README.md and the pages under ``docs/`` are written to be read on the forge, where ``../benchmarks/RESULTS.md`` or
``../LICENSE`` opens that file. MkDocs serves ``docs/`` only, so:

* ``index.md`` is generated from README.md, which stays the single source: its links into ``docs/`` become links
  between pages (``docs/usage.md`` -> ``usage.md``), its links to other repository files are handled as below.
* Every relative link that resolves outside ``docs/`` must name a file or folder of the repository: a missing one
  is an error, so ``mkdocs build --strict`` fails naming the page and the link. It becomes the target's address on
  the forge, ``<repo_url>/blob/<branch>/<path>`` (``tree`` for a folder), the branch read from ``edit_uri``
  (``edit/<branch>/docs/``). A link to a section of a Markdown file (``../benchmarks/ARCHIVE.md#lora``) must name
  one of its headings as the forge writes their anchors (the site's own rule too: ``toc.slugify`` in mkdocs.yml), or
  it is an error as well. A link to README.md becomes a link to the home page.

Links between pages under ``docs/`` and their anchors are MkDocs's own to check (``validation`` in mkdocs.yml). Links
inside code (fenced blocks, code spans) are left alone.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from mkdocs.structure.files import File, Files
from pymdownx.slugs import slugify

log = logging.getLogger("mkdocs.hooks.repository_links")

README = "README.md"
HOME = "index.md"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)")
# [text](target "title") and ![alt](target): the target, bare or in <...>
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]\\]|\\.|\[(?:[^\[\]\\]|\\.)*\])*\]\(\s*(<[^<>\n]*>|[^\s()<>]+)")
# [label]: target
_REFERENCE = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*(<[^<>\n]*>|\S+)")
_BRANCH = re.compile(r"^(?:edit|blob|tree|raw)/([^/]+)/")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_HTML_ID = re.compile(r"""<[^>]*\s(?:id|name)=["']([^"']+)["']""")
MARKDOWN = (".md", ".markdown")
SLUG = slugify(case="lower")  # the headings' ids on the site (mkdocs.yml's toc.slugify) and on the forge


def lines_outside_fences(markdown: str):
    """``(offset, line)`` of each line outside fenced code blocks, the fence lines excluded."""
    offset, fence = 0, None
    for line in markdown.splitlines(keepends=True):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
        elif opened:
            fence = opened.group(1)
        else:
            yield offset, line
        offset += len(line)


def link_targets(markdown: str):
    """``(start, end)`` of every link target outside code, in order."""
    spans = []
    for offset, line in lines_outside_fences(markdown):
        shadow = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)  # same offsets, no code
        for pattern in (_INLINE_LINK, _REFERENCE):
            spans += [(offset + m.start(1), offset + m.end(1)) for m in pattern.finditer(shadow)]
    return sorted(spans)


def forge_anchors(path: Path) -> frozenset[str]:
    """The section anchors the forge gives a Markdown file: its headings' ids by the site's own rule (``SLUG``: lower
    case, every character other than a letter, a digit, ``_``, ``-`` or a space dropped, each space a ``-``), a
    repeated one suffixed ``-1``, ``-2``, ...; plus the ids of its HTML elements."""
    anchors, seen = set(), {}
    for _, line in lines_outside_fences(path.read_text(encoding="utf-8")):
        anchors.update(_HTML_ID.findall(line))
        heading = _HEADING.match(line)
        if heading:
            slug = SLUG(_LINK_TEXT.sub(r"\1", heading.group(1)).strip(), "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def rewrite_links(markdown: str, rewrite: Callable[[str], str | None]) -> str:
    """``markdown`` with each link target ``t`` outside code replaced by ``rewrite(t)`` (``None``: kept)."""
    out, last = [], 0
    for start, end in link_targets(markdown):
        new = rewrite(markdown[start:end])
        if new is not None:
            out += [markdown[last:start], new]
            last = end
    return "".join(out + [markdown[last:]])


class RepositoryLinks:
    """Resolves a page's relative links against the repository (the folder holding mkdocs.yml)."""

    def __init__(self, config) -> None:
        self.root = Path(config.config_file_path).parent.absolute()
        self.docs = Path(config.docs_dir).absolute()
        self.repo_url = (config.repo_url or "").rstrip("/")
        branch = _BRANCH.match(config.edit_uri or "")
        self.branch = branch.group(1) if branch else "main"

    def rewriter(self, source: str, base: Path, page_dir: str) -> Callable[[str], str | None]:
        """For a page read from ``source`` (for messages) whose links are relative to the folder ``base``, and
        which the site serves from ``page_dir`` (relative to ``docs/``)."""

        def rewrite(raw: str) -> str | None:
            bracketed = raw.startswith("<")
            new = resolve(raw[1:-1] if bracketed else raw)
            return f"<{new}>" if bracketed and new is not None else new

        def resolve(link: str) -> str | None:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
                return None  # an address, a same-page anchor, or a site-absolute path (MkDocs warns about those)
            target = Path(os.path.normpath(base / unquote(parts.path)))
            fragment = f"#{parts.fragment}" if parts.fragment else ""
            in_docs = target == self.docs or self.docs in target.parents
            if in_docs and (base == self.docs or self.docs in base.parents):
                return None  # between pages: MkDocs checks it, anchors included
            if self.root != target and self.root not in target.parents:
                log.error(f"{source}: the link '{link}' leaves the repository; link to an address instead")
                return None
            path = target.relative_to(self.root).as_posix()
            if not target.exists():
                log.error(f"{source}: the link '{link}' points to '{path}', which is not in the repository")
                return None
            if in_docs:  # README.md's link to a page
                return posixpath.relpath(target.relative_to(self.docs).as_posix(), page_dir or ".") + fragment
            if path == README:
                return posixpath.relpath(HOME, page_dir or ".") + fragment  # MkDocs checks the anchor
            section = unquote(parts.fragment)
            if section and target.suffix.lower() in MARKDOWN and section not in forge_anchors(target):
                log.error(f"{source}: the link '{link}' points to a section '#{section}' that '{path}' does not have")
                return None
            if not self.repo_url:
                log.error(f"{source}: the link '{link}' leaves docs/, and mkdocs.yml sets no repo_url to send it to")
                return None
            kind = "tree" if target.is_dir() else "blob"
            return f"{self.repo_url}/{kind}/{self.branch}/{quote(path)}{fragment}"

        return rewrite


def on_files(files: Files, config) -> Files:
    """Add the home page, generated from README.md."""
    links = RepositoryLinks(config)
    if files.get_file_from_path(HOME) is not None:
        log.error(f"docs/{HOME} exists, but the home page is generated from {README}: remove docs/{HOME}")
        return files
    readme = (links.root / README).read_text(encoding="utf-8")
    content = rewrite_links(readme, links.rewriter(README, links.root, ""))
    files.append(File.generated(config, HOME, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Links that leave ``docs/``: checked against the repository and sent to the forge."""
    links = RepositoryLinks(config)
    source = page.file.src_uri
    if source == HOME and page.file.generated_by is not None:
        return markdown  # README.md, rewritten in on_files
    page_dir = posixpath.dirname(source)
    return rewrite_links(markdown, links.rewriter(f"docs/{source}", links.docs / page_dir, page_dir))
