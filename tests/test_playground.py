"""The playground in a real headless Chromium (Debian's package, driven by Playwright) against `lmserve serve`.

Streams a generation and sees it grow, changes a parameter, reads a token's alternatives, shares it and
reopens the permalink in a new page, runs the curl, Python and (with Node 18+) JavaScript exports against
the server, deletes the saved example; completion mode; markup in model output stays text; and with
--api-key: the page asks for the key, works with it, and the key is in neither the share file nor a share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.server_util import running_server

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install -e '.[test]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NODE = shutil.which("node")  # optional: the JavaScript export runs where Node is installed
KEY = "sk-playground-secret-7f3a"
PROMPT = "Name three colors."
TIMEOUT_MS = 60_000
pytestmark = pytest.mark.slow  # two server starts and a browser: 40-55 s on 2 cores


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium package (apt-get install chromium; scripts/install.sh test does it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("--playground-db", str(tmp_path_factory.mktemp("playground") / "shares.sqlite3")) as s:
        yield s


def new_page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    return page


def record_output_lengths(page) -> None:
    """Every length the output's text takes, as the page changes it (to see a stream arrive in pieces)."""
    page.evaluate("""() => {
        window.outputLengths = [];
        const out = document.getElementById('output');
        new MutationObserver(() => window.outputLengths.push(out.textContent.length))
            .observe(out, {childList: true, subtree: true, characterData: true});
    }""")


def generate(page, prompt: str, max_tokens: int) -> None:
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_role("button", name="Generate").click()
    page.wait_for_selector('#status[data-state="done"]', timeout=TIMEOUT_MS)


def token_tooltip(page, index: int) -> list[str]:
    """Hover token `index` and read its tooltip's rows (alternative and probability)."""
    page.locator("#output .tok").nth(index).hover()
    tooltip = page.get_by_role("tooltip")
    tooltip.wait_for(state="visible")
    return [row.inner_text().replace("\n", " ").replace("\t", " ") for row in tooltip.locator("li").all()]


def exported(page, lang: str) -> str:
    """The export for `lang`, through the page's Copy button and the clipboard."""
    page.get_by_role("tab", name=lang).click()
    page.get_by_role("button", name="Copy code").click()
    page.get_by_role("button", name="Copied").wait_for()  # the page's write to the clipboard has finished
    return page.evaluate("navigator.clipboard.readText()")


def has_node_fetch() -> bool:
    """Node 18 or later is installed: the JavaScript export's target (it has a global fetch)."""
    if NODE is None:
        return False
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True).stdout.strip()
    return int(version.lstrip("v").split(".")[0] or 0) >= 18


def run_curl(code: str, env: dict | None = None) -> dict:
    """The exported curl command as bash runs it, with its status appended; its JSON answer."""
    out = subprocess.run(["bash", "-c", code + " -sS -w '\\n%{http_code}'"], capture_output=True, text=True,
                         timeout=120, env=env)
    body, _, status = out.stdout.rpartition("\n")
    assert out.returncode == 0 and status == "200", (out.returncode, out.stdout[-500:], out.stderr[-500:])
    return json.loads(body)


def test_stream_tokens_share_permalink_and_exports(browser, server):
    page = new_page(browser)
    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    page.get_by_label("Temperature", exact=True).fill("0")
    record_output_lengths(page)
    generate(page, PROMPT, 24)

    final = page.locator("#output").text_content()
    partial = {n for n in page.evaluate("window.outputLengths") if 0 < n < len(final)}
    assert len(partial) >= 2, f"the output did not grow in pieces: {page.evaluate('window.outputLengths')}"
    tokens = page.locator("#output .tok")
    assert tokens.count() >= 3
    rows = token_tooltip(page, 1)
    assert len(rows) == 5 and all(r.endswith("%") for r in rows), rows
    assert page.locator("#tooltip li.chosen").count() == 1  # the token taken is marked among them

    page.get_by_role("button", name="Share").click()
    page.wait_for_function("() => document.getElementById('share-url').value.includes('/p/')")
    link = page.get_by_label("Permalink").input_value()
    assert page.url == link  # the address bar holds the permalink too
    page.get_by_role("link", name=PROMPT).wait_for()  # listed among the saved examples (just one: strict)

    again = new_page(browser)
    again.goto(link)
    again.wait_for_selector('#status[data-state="loaded"]', timeout=TIMEOUT_MS)
    assert again.get_by_label("Prompt", exact=True).input_value() == PROMPT
    assert again.get_by_label("Temperature", exact=True).input_value() == "0"
    assert again.get_by_label("Max tokens").input_value() == "24"
    assert again.locator("#output").text_content() == final
    assert again.locator("#output .tok").count() == tokens.count()
    assert token_tooltip(again, 1) == rows  # the token view's logprobs came back too

    answer = run_curl(exported(page, "curl"))
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert answer["choices"][0]["message"]["content"] == final.removesuffix("<|im_end|>")  # greedy: same text
    code = exported(page, "Python")
    py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert py.returncode == 0 and py.stdout.strip(), py.stderr[-2000:]
    js = exported(page, "JavaScript")
    if has_node_fetch():
        out = subprocess.run([NODE, "-e", js], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == py.stdout.strip(), out.stderr[-2000:]

    page.get_by_role("button", name=f"Delete {PROMPT}").click()  # from the saved examples
    page.get_by_role("link", name=PROMPT).wait_for(state="detached")
    again.reload()
    again.get_by_text("This permalink does not exist").wait_for()
    assert not page.errors and not again.errors


def test_model_output_stays_text(browser, server):
    """Output that looks like markup is shown as characters, never parsed: the model can write <script>."""
    evil = "<img src=x onerror=window.pwned=1><b>bold</b>"
    body = {"mode": "completion", "model": "m", "prompt": "p", "params": {},
            "output": {"text": evil, "tokens": [{"token": evil, "logprob": -1.0, "top": []}]}}
    share = httpx.post(server.url + "/playground/api/shares", json=body).json()
    page = new_page(browser)
    page.goto(server.url + share["url"])
    page.wait_for_selector('#status[data-state="loaded"]', timeout=TIMEOUT_MS)
    assert page.locator("#output").text_content() == evil
    assert page.locator("#output img, #output b").count() == 0
    assert page.evaluate("window.pwned") is None


def test_completion_mode(browser, server):
    page = new_page(browser)
    page.goto(server.url + "/playground")
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    page.get_by_label("Completion").check()
    assert page.get_by_label("System prompt").is_hidden()
    page.get_by_label("Seed").fill("7")
    generate(page, "The capital of France is", 8)
    assert page.locator("#output .tok").count() == 8
    assert len(token_tooltip(page, 0)) == 5
    word = page.evaluate("() => [...document.querySelectorAll('#output .tok')].findIndex((t, i) => i && t.textContent.trim())")
    rows = token_tooltip(page, word)
    page.locator("#output .tok").nth(word).focus()  # by keyboard, or a tap: the focused token keeps the tooltip
    page.mouse.move(1, 1)  # the pointer leaves the output
    assert page.get_by_role("tooltip").is_visible()
    assert [r.inner_text().replace("\n", " ").replace("\t", " ") for r in page.locator("#tooltip li").all()] == rows
    page.keyboard.press("Escape")
    assert page.get_by_role("tooltip").is_hidden()
    code = exported(page, "Python")
    assert "client.completions.create(" in code and "seed=7," in code
    py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert py.returncode == 0 and py.stdout.strip(), py.stderr[-2000:]
    assert run_curl(exported(page, "curl"))["object"] == "text_completion"
    assert not page.errors


def test_api_key_is_asked_sent_and_never_stored(browser, tmp_path):
    db = tmp_path / "shares.sqlite3"
    with running_server("--api-key", KEY, "--playground-db", str(db), headers={"Authorization": f"Bearer {KEY}"}) as s:
        page = new_page(browser)
        page.goto(s.url + "/playground")
        dialog = page.get_by_role("dialog")
        dialog.wait_for(state="visible")
        dialog.get_by_label("API key").fill("wrong-key")
        dialog.get_by_role("button", name="Use key").click()
        page.get_by_text("That key was refused").wait_for(state="visible")
        dialog.get_by_label("API key").fill(KEY)
        dialog.get_by_role("button", name="Use key").click()
        page.wait_for_function("() => document.getElementById('model').options.length > 0")
        generate(page, PROMPT, 6)
        assert page.locator("#output .tok").count() >= 1
        page.get_by_role("button", name="Share").click()
        page.wait_for_function("() => document.getElementById('share-url').value.includes('/p/')")
        link = page.get_by_label("Permalink").input_value()
        share_id = link.rsplit("/", 1)[1]

        assert page.evaluate("localStorage.length") == 0 and not page.context.cookies()  # sessionStorage at most
        again = new_page(browser)  # another browser profile: no key yet
        again.goto(link)
        again.get_by_role("dialog").get_by_label("API key").fill(KEY)
        again.get_by_role("button", name="Use key").click()
        again.wait_for_selector('#status[data-state="loaded"]', timeout=TIMEOUT_MS)
        assert again.locator("#output").text_content() == page.locator("#output").text_content()
        curl = exported(page, "curl")
        assert KEY not in curl and "$LMSERVE_API_KEY" in curl
        assert run_curl(curl, env={"PATH": "/usr/bin:/bin", "LMSERVE_API_KEY": KEY})["choices"]
        code = exported(page, "Python")
        assert KEY not in code
        py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LMSERVE_API_KEY": KEY})
        assert py.returncode == 0, py.stderr[-2000:]
        js = exported(page, "JavaScript")
        assert KEY not in js and "process.env.LMSERVE_API_KEY" in js
        if has_node_fetch():  # without the key, body.choices is undefined and node exits 1
            out = subprocess.run([NODE, "-e", js], capture_output=True, text=True, timeout=120,
                                 env={"PATH": "/usr/bin:/bin", "LMSERVE_API_KEY": KEY})
            assert out.returncode == 0, out.stderr[-2000:]

        shared = httpx.get(f"{s.url}/playground/api/shares/{share_id}", headers={"Authorization": f"Bearer {KEY}"})
        assert shared.status_code == 200 and KEY not in shared.text
        assert httpx.get(f"{s.url}/playground/api/shares/{share_id}").status_code == 401
        assert httpx.get(s.url + "/p/" + share_id).status_code == 200  # the page itself is open
    for path in db.parent.iterdir():  # the database and any journal it left
        assert KEY.encode() not in path.read_bytes(), path


def test_image_picker_sends_a_data_url_part_and_shows_a_text_models_refusal(browser, server):
    """The picked file goes as the user message's `image_url` part (a data: URL, in the export too); the
    embedded model is text-only, so the server's 400 shows in the status; removed, the prompt runs as text."""
    from tests.test_media import image_bytes

    page = new_page(browser)
    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    page.locator("#image").set_input_files({"name": "cat.png", "mimeType": "image/png", "buffer": image_bytes()})
    page.get_by_alt_text("The attached image").wait_for()  # the preview
    page.wait_for_function("() => document.getElementById('export-code').textContent.includes('data:image/png;base64,')")
    assert '"image_url"' in exported(page, "curl")
    generate_until(page, "Describe this image.", "error")
    assert "does not accept images" in page.locator("#status").text_content()

    page.get_by_role("button", name="Remove image").click()
    assert page.get_by_alt_text("The attached image").is_hidden()
    assert "image_url" not in page.locator("#export-code").text_content()
    generate(page, PROMPT, 4)
    assert page.locator("#output").text_content()
    page.get_by_label("Completion").check()
    assert page.locator("#image").is_hidden()  # a completion prompt takes no image
    assert not page.errors, page.errors


def generate_until(page, prompt: str, state: str) -> None:
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_label("Max tokens").fill("4")
    page.get_by_role("button", name="Generate").click()
    page.wait_for_selector(f'#status[data-state="{state}"]', timeout=TIMEOUT_MS)
