"""The documentation: the options page is what `ExportOptions` generates, and the MkDocs site
builds with every link and image resolving (`mkdocs build --strict`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rayexport.orchestration.options import option_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_options_page_is_generated_from_the_code():
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == option_reference(), "docs/options.md is stale: python -m rayexport.orchestration.options > docs/options.md"


def test_the_site_builds_strictly(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert (tmp_path / "site" / "options" / "index.html").exists()
    assert (tmp_path / "site" / "performance" / "index.html").exists()
