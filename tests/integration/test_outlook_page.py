"""The outlook's HTML page, rendered by a real headless Chromium (Debian's package; CI installs
it): every cell is on the page and links where it says."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _outlook(cli, project, *args):
    return cli("outlook", "--index-url", project.index.url, *args, cwd=project.root)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_html_page_renders_the_matrix_in_chromium(cli, project, tmp_path):
    if _chromium() is None:  # .ci/run installs Debian's: under CI=true this skip fails
        pytest.skip("needs chromium (apt-get install chromium; .ci/run installs it)")
    page = tmp_path / "outlook.html"
    res = _outlook(cli, project, "--html", page)
    assert res.rc == 0, res.err
    shot = tmp_path / "shot.png"
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(
        [*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    from html.parser import HTMLParser

    cells: list[dict] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "td" and "data-state" in a:
                cells.append(a)

    P().feed(dom)
    got = {(c["data-change"], c["data-version"]): c["data-state"] for c in cells}
    assert got == {
        ("group-block-size", "1.1.0"): "refreshed",
        ("group-block-size", "1.2.0"): "conflict",
    }
    assert 'id="cell-group-block-size-1_2_0"' in dom and "upstream rewrote this" in dom
    assert 'href="#cell-group-block-size-1_2_0"' in dom
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1000,600", page.as_uri()],
                   capture_output=True, timeout=120)  # fmt: skip
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
