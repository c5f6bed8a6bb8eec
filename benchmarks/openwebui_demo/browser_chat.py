"""Drives Open-WebUI in a real headless Chromium (Playwright, the system's browser): opens the UI, closes the
release-notes dialog, picks the model in the model selector, sends one message, waits for the streamed answer to
finish and saves a screenshot.

    python benchmarks/openwebui_demo/browser_chat.py --url http://127.0.0.1:8080 --model tutel-jax-chat \
        --out docs/images/openwebui_chat.png

Run it with the Python of the Open-WebUI environment, where `pip install playwright` put the Playwright client
(no `playwright install`: it launches the system's Chromium, --chromium, Debian's package `chromium`).
The screenshot is cropped to the chat and kept under 500 KB (Pillow).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


async def chat(url: str, model: str, message: str, out: Path, chromium: str, timeout_s: float,
               settle_s: float, wait_log: Path | None = None, wait_posts: int = 0) -> str:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory(prefix="owui-chromium-") as profile:
        async with async_playwright() as p:
            ctx = await p.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page = ctx.pages[0] if ctx.pages else await ctx.new_page()
            page.set_default_timeout(timeout_s * 1000)
            await page.goto(url, wait_until="domcontentloaded")

            # a fresh data dir shows the release notes ("What's New") first
            lets_go = page.get_by_role("button", name="Okay, Let's Go!")
            chat_input = page.locator("#chat-input")
            await lets_go.or_(chat_input).first.wait_for()
            if await lets_go.is_visible():
                await lets_go.click()

            # pick the model (with one model it is preselected; choose it explicitly anyway)
            await page.locator("#model-selector-model-button, button[aria-label^='Selected model']").first.click()
            await page.get_by_role("button", name=model).or_(page.get_by_text(model, exact=True)).last.click()
            await page.get_by_label(f"Selected model: {model}").first.wait_for()

            await chat_input.click()
            await page.keyboard.type(message)
            await page.keyboard.press("Enter")

            # the user's message, then the assistant's answer; done when the stop button is gone and the answer's
            # action buttons (copy, regenerate, ...) show
            await page.get_by_text(message).first.wait_for()
            answer = page.locator("#response-content-container").last
            await answer.wait_for()
            deadline = time.monotonic() + timeout_s
            while await page.locator("button[aria-label='Stop']").count() or \
                    not await page.get_by_label("Copy").count():
                if time.monotonic() > deadline:
                    raise TimeoutError("the answer did not finish streaming")
                await page.wait_for_timeout(250)
            text = await answer.inner_text()
            # title, tags and follow-up generation run after the answer: wait for them (seen in the proxy's log)
            deadline = time.monotonic() + timeout_s
            while wait_log is not None and _posts(wait_log) < wait_posts:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{wait_log} has {_posts(wait_log)} POSTs, not {wait_posts}")
                await page.wait_for_timeout(500)
            await page.wait_for_timeout(settle_s * 1000)  # and for the page to show their results
            raw = out.with_suffix(".raw.png")
            await page.screenshot(path=str(raw))
            await ctx.close()
    _shrink(raw, out)
    raw.unlink()
    return text


def _posts(log: Path) -> int:
    """The POST requests a record_proxy.py log holds so far."""
    import json
    if not log.is_file():
        return 0
    return sum(json.loads(line)["method"] == "POST" for line in log.read_text().splitlines() if line.strip())


def _shrink(src: Path, dst: Path, limit: int = 500_000):
    """A PNG under `limit` bytes (palette-quantized, scaled down if still too large)."""
    from PIL import Image
    img = Image.open(src).convert("RGB")
    scale = 1.0
    while True:
        im = img if scale == 1.0 else img.resize((int(img.width * scale), int(img.height * scale)), Image.LANCZOS)
        im.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(dst, optimize=True)
        if dst.stat().st_size < limit or scale < 0.3:
            return
        scale *= 0.8


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="tutel-jax-chat")
    p.add_argument("--message", default="Hello! Who are you?")
    p.add_argument("--out", type=Path, default=Path("docs/images/openwebui_chat.png"))
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--timeout", type=float, default=180, help="seconds for each step")
    p.add_argument("--settle", type=float, default=5, help="seconds to wait before the screenshot")
    p.add_argument("--wait-log", type=Path, default=None,
                   help="a record_proxy.py log: before the screenshot, wait until it holds --wait-posts POSTs")
    p.add_argument("--wait-posts", type=int, default=4,
                   help="the chat, then title, follow-up and tags generation (Open-WebUI 0.12's defaults)")
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = asyncio.run(chat(a.url, a.model, a.message, a.out, a.chromium, a.timeout, a.settle, a.wait_log,
                            a.wait_posts))
    print(f"answer: {text!r}\nscreenshot: {a.out} ({a.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
