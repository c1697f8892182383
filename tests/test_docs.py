"""The documentation: the docs/ site builds in strict mode, and README.md stays short.

`mkdocs build --strict` fails on a link to a missing page or anchor, a page left out of
the nav, and a `::: name` the API reference cannot find (mkdocs.yml's `validation`), so a
renamed public name or a moved page shows up here. The build reads the sources statically
(griffe) and takes a few seconds; nothing is imported or compiled.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 250  # issue 34: what jcp is, install, two commands, a tour, links


def test_docs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]"; [test] includes it)')
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_readme_is_short():
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_readme_links_exist():
    # README.md is not part of the site, so mkdocs does not check its links into docs/.
    with open(README, encoding="utf-8") as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    assert local, "README.md links to no page of docs/"
    missing = [t for t in local if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README.md links to missing files: {missing}"
