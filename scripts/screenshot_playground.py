"""Make docs/playground.png: the playground after a generation, shared, with a token's alternatives shown.

    python scripts/screenshot_playground.py [--url http://127.0.0.1:8000] [--out docs/playground.png]

Without --url it starts `lmserve serve` (the embedded model) on a free port, with a throwaway share file.
Needs playwright (the test extras) and Debian's chromium package.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a concise assistant."
PROMPT = "Explain in two sentences why a paged KV cache lets a server batch more requests."


@contextlib.contextmanager
def served(url: str | None):
    """`url`, or a fresh `lmserve serve` on a free port until the block ends."""
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--log-level",
                                 "warning", "--playground-db", str(Path(tmp) / "shares.sqlite3")])
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lmserve serve exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def least_likely_token(page, first: int = 8, last: int = 40) -> int:
    """The index of the least likely token in [first, last): its tooltip shows a real choice, below the first line."""
    return first + page.evaluate(f"""() => {{
        const shades = [...document.querySelectorAll('#output .tok')].slice({first}, {last});
        const hue = (el) => Number(el.style.getPropertyValue('--shade').match(/hsl\\((\\d+)/)[1]);
        return shades.reduce((best, el, i) => hue(el) < hue(shades[best]) ? i : best, 0);
    }}""")


def capture(url: str, out: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860}, device_scale_factor=1)
        page.goto(url + "/playground")
        page.wait_for_function("() => document.getElementById('model').options.length > 0")
        page.get_by_label("System prompt").fill(SYSTEM)
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        page.get_by_label("Temperature", exact=True).fill("0.7")
        page.get_by_label("Seed").fill("11")
        page.get_by_label("Max tokens").fill("72")
        page.get_by_role("button", name="Generate").click()
        page.wait_for_selector('#status[data-state="done"]', timeout=300_000)
        page.get_by_role("button", name="Share").click()
        page.wait_for_function("() => document.getElementById('share-url').value.includes('/p/')")
        page.locator("#output .tok").nth(least_likely_token(page)).hover()
        page.get_by_role("tooltip").wait_for(state="visible")
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out))
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "playground.png"))
    args = parser.parse_args()
    with served(args.url) as url:
        capture(url, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
