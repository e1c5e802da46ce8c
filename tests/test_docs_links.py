"""Every relative link in README.md and docs/*.md points at a file of the repository, and no document names a path
of one machine (a home directory or a temporary folder)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    links = [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if not re.match(r"[a-z]+://|mailto:", m)]
    broken = [link for link in links if not os.path.exists(os.path.normpath(os.path.join(base, link)))]
    assert not broken, f"{doc} links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS)
def test_no_machine_paths(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    found = re.findall(r"(?:/home/|/root/|/tmp/|/work/|/Users/)[\w./-]+", text)
    assert not found, f"{doc} names paths of one machine: {found}"
