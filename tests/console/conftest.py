"""Console tests: a real hub (and real agents) driven by Debian's headless Chromium through Playwright.

Never ``playwright install``: the browser is the distribution's ``/usr/bin/chromium``
(``scripts/setup-system.sh`` installs it). Without it these tests fail, they do not skip:
a console nobody has looked at in a browser is not tested.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = os.environ.get("MESH_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
DESKTOP = {"width": 1366, "height": 900}
PHONE = {"width": 375, "height": 812}


@pytest.fixture
def browser_context(tmp_path: Path) -> Iterator[Any]:
    """A fresh Chromium profile (its own user-data dir) with one context; closed afterwards."""
    if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
        pytest.fail(f"console tests need Debian's Chromium at {CHROMIUM}: run `./taskw setup` (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("console tests need the Python package playwright (pip install -e '.[dev]'); never `playwright install`")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport=DESKTOP, locale="en-US", timezone_id="UTC",
        )
        try:
            yield ctx
        finally:
            ctx.close()
