"""The documentation site: it builds with warnings as errors, and every link in it and in the README resolves.

MkDocs checks the links between pages and their anchors itself (``validation`` in ``mkdocs.yml``,
made errors by ``strict``); these tests also read the built HTML (every relative link names a file
of the site, every ``#anchor`` an element of its page) and the README's relative links (files of
the repository; anchors of a ``docs/`` page are its headings). External links are not fetched: the
test machines have no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, NO_MKDOCS_2_WARNING="1")


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=project, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value and tag in ("a", "link", "img", "script"):
                self.hrefs.append(value)


def _read(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    assert (site / "index.html").is_file()
    for page in ("vllm", "megatron", "verl", "evaluation", "offline", "doctor", "core", "development"):
        assert (site / page / "index.html").is_file(), page


def test_every_page_of_docs_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages
    assert [p for p in pages if f": {p}" not in nav] == []


def test_every_relative_link_and_anchor_of_the_built_site_resolves(site: Path) -> None:
    pages = {p: _read(p) for p in site.rglob("*.html")}
    broken = []
    for page, links in pages.items():
        for href in links.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "data:")):
                continue
            if not parts.path:
                target = page
            elif parts.path.startswith("/"):  # the 404 page links from the site's root
                target = (site / unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _read(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert broken == []


def _slug(heading: str) -> str:
    """The anchor MkDocs' ``toc`` extension gives a heading (its default slugify)."""
    text = re.sub(r"[`*_\[\]]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_the_readme_stays_short() -> None:
    """The README says what the package is, how to install it, one example per framework and links; the
    reference material (benchmark tables, deployment options) lives in the docs."""
    size = len((ROOT / "README.md").read_bytes())
    assert size < 6 * 1024, f"README.md is {size} bytes; move detail into docs/"


def test_the_readme_links_resolve_to_files_and_headings() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    broken = []
    for link in links:
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue
        target = ROOT / parts.path
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif parts.fragment:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            if parts.fragment not in {_slug(h) for h in headings}:
                broken.append(f"{link} (no such heading)")
    assert broken == []


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The checks above can fail: the same site with one link to a missing page does not build."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", project / "docs")
    for name in ("CHANGELOG.md", "ARCHITECTURE.md"):  # the pages that include them (pymdownx.snippets)
        shutil.copy(ROOT / name, project / name)
    page = project / "docs" / "vllm.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md#nowhere).\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr
