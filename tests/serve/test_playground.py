"""The playground page in a real headless browser (Debian's chromium, driven by
playwright-python with ``executable_path``: no browser download), against the
session's real server: a prompt typed and generated shows progress, previews
and an image of the requested size; a bad size shows the API's message; an
image dropped on the page (and a mask) is edited through v1/images/edits;
the Video tab plays the default video model's clip."""

from __future__ import annotations

import base64
import io
import os
import shutil

import pytest
from serve_helpers import API_KEY

pytestmark = pytest.mark.e2e

#: where scripts/test.sh installs it (apt's chromium)
CHROMIUM = os.environ.get("DIFFRT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no chromium at {CHROMIUM}: scripts/test.sh installs Debian's chromium")
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox cannot start
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, real_server):
    page = browser.new_page(viewport={"width": 1000, "height": 640})
    page.goto(f"{real_server.url}/")
    page.fill("#apikey", API_KEY)
    yield page
    page.close()


def test_generating_shows_progress_previews_and_the_image(page, tmp_path):
    page.fill("#prompt", "a red fox in the snow")
    page.fill("#size", "96x64")
    page.fill("#steps", "12")
    page.fill("#seed", "3")
    # record every value the progress bar takes (value is a reflected
    # attribute: each change leaves a record with the value it replaced)
    page.evaluate("""() => {
        const bar = document.getElementById('progress');
        window.progressSeen = [];
        new MutationObserver((records) => {
            for (const r of records) window.progressSeen.push(Number(r.oldValue));
            window.progressSeen.push(Number(bar.value));
        }).observe(bar, {attributes: true, attributeFilter: ['value'], attributeOldValue: true});
    }""")
    page.click("#generate")
    page.wait_for_function("document.getElementById('status').textContent === 'Done.'",
                           timeout=60_000)
    size = page.eval_on_selector(
        "#result", "async e => { await e.decode(); return [e.naturalWidth, e.naturalHeight]; }")
    assert size == [96, 64]
    seen = page.evaluate("window.progressSeen")
    assert any(0 < v < 12 for v in seen), seen  # it moved before the end
    assert page.locator("#previews img").count() >= 1
    assert "seed 3" in page.text_content("#caption")
    assert page.locator("#history li").count() == 1
    assert page.text_content("#error") == ""
    page.screenshot(path=str(tmp_path / "playground.png"))


def _generate(page) -> str:
    page.click("#generate")
    page.wait_for_function("document.getElementById('status').textContent === 'Done.'",
                           timeout=60_000)
    return page.get_attribute("#result", "src")


def test_reuse_reproduces_a_random_seed_and_errors_show_their_message(page):
    page.fill("#size", "64x64")
    page.fill("#steps", "3")
    page.fill("#seed", "")  # the server draws one
    first = _generate(page)
    page.click("#history li button")  # Reuse: the drawn seed comes back into the form
    assert page.input_value("#seed") != ""
    assert _generate(page) == first  # the same image
    page.fill("#size", "65x64")
    page.click("#generate")
    page.wait_for_function("document.getElementById('error').textContent.length > 0",
                           timeout=30_000)
    assert "width: must be a positive multiple of 4" in page.text_content("#error")
    assert page.is_hidden("#result")  # the last image is not left beside the error


def test_an_edit_sends_the_dropped_image_and_its_mask_and_shows_the_result(page, tmp_path):
    """An image dropped on the page and a mask picked with the file input: the
    page posts a multipart edit to v1/images/edits, shows its previews and
    the edited image; "Clear images" turns the button back to Generate."""
    from PIL import Image

    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))  # white: repaint the middle
    mask.save(tmp_path / "mask.png")
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (250, 220, 0)).save(picture, format="PNG")
    page.fill("#prompt", "a red circle on a yellow background in the center")
    page.fill("#size", "64x64")
    page.fill("#steps", "12")
    page.fill("#seed", "4")
    page.fill("#strength", "0.9")
    page.evaluate("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const files = new DataTransfer();
        files.items.add(new File([bytes], "in.png", {type: "image/png"}));
        const drop = new DragEvent("drop", {dataTransfer: files, bubbles: true, cancelable: true});
        document.getElementById("dropzone").dispatchEvent(drop);
    }""", base64.b64encode(picture.getvalue()).decode())
    page.set_input_files("#mask", str(tmp_path / "mask.png"))
    assert page.text_content("#generate") == "Edit"
    assert page.locator("#inputs img").count() == 2  # the image and the mask, shown
    with page.expect_request("**/v1/images/edits") as sent:
        page.click("#generate")
    assert "multipart/form-data" in sent.value.headers["content-type"]
    page.wait_for_function("document.getElementById('status').textContent === 'Done.'",
                           timeout=60_000)
    assert page.text_content("#error") == ""
    size = page.eval_on_selector(
        "#result", "async e => { await e.decode(); return [e.naturalWidth, e.naturalHeight]; }")
    assert size == [64, 64]
    assert page.locator("#previews img").count() >= 1
    assert "seed 4" in page.text_content("#caption")
    page.screenshot(path=str(tmp_path / "playground-edit.png"))
    page.click("#clear")
    assert page.text_content("#generate") == "Generate"
    assert page.locator("#inputs img").count() == 0


def test_the_video_tab_shows_progress_and_plays_the_default_models_clip(page):
    """The Video tab on the default server, as a newcomer finds it: its prompt
    as the page offers it, every setting the model's. The job runs on the
    default video model (diffrt-motion, beside diffrt-shapes), its progress
    moves, then the MP4 plays in a <video> element (its duration read from
    the file: 9 frames at 8 fps)."""
    page.click("#tab-video")
    assert page.input_value("#vprompt") == (
        "a red circle moving left to right on a yellow background")
    page.fill("#vseed", "0")
    with page.expect_request("**/v1/videos") as sent:
        page.click("#vgenerate")
    assert "multipart/form-data" in sent.value.headers["content-type"]
    page.wait_for_function("document.getElementById('vstatus').textContent === 'Done.'",
                           timeout=60_000)
    assert page.text_content("#verror") == ""
    page.wait_for_function("document.getElementById('vresult').readyState >= 1",
                           timeout=30_000)
    duration = page.eval_on_selector("#vresult", "v => v.duration")
    assert 1.0 <= duration <= 1.2, duration  # 9 frames at 8 fps: 1.125 s
    assert page.eval_on_selector("#vprogress", "p => p.value") == 100
