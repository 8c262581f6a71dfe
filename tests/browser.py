"""A real browser for the tests of `hpipe serve`'s page: headless Chromium (Debian's `chromium`,
which .ci/run installs) driven by Playwright for Python, pointed at the system browser (its own
browser download cannot work here). `unavailable_reason()` says why the tests skip where either is
missing outside CI."""

from __future__ import annotations

import contextlib
import shutil
import time

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM) if p), None)


def unavailable_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; it drives the system's Chromium)"
    if chromium_path() is None:
        return "no Chromium (apt-get install chromium; .ci/run installs it)"
    return None


@contextlib.contextmanager
def browser():
    """A headless Chromium; each test opens its own pages (`page(b, base, key)`)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def open_page(b, base: str, key: str | None, width: int = 1280):
    """The page at `base`, its key given (when the server has one), once it shows the stages. Its
    console errors and page errors land in `page.problems`."""
    page = b.new_page(viewport={"width": width, "height": 1000})
    page.problems = []
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.on("console", lambda m: page.problems.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.goto(base + "/")
    if key is not None:
        page.wait_for_selector("#key", state="visible")
        page.fill("#key", key)
        page.click("#keyform button")
    page.wait_for_selector("#stages tr")
    return page


def page_value(page, metric: str) -> float:
    """A number the page shows for the /metrics sample `metric`."""
    return float(page.get_attribute(f"[data-metric='{metric}']", "data-value"))


def polls(page) -> int:
    return int(page.evaluate("Number(document.body.dataset.polls || 0)"))


def wait_until(page, expression: str, timeout_s: float = 30.0) -> None:
    """Until `expression` is true in the page. Polled from here: Playwright's wait_for_function
    evaluates a string in the page, which its Content-Security-Policy refuses (no 'unsafe-eval')."""
    deadline = time.time() + timeout_s
    while not page.evaluate(expression):
        assert time.time() < deadline, f"the page never had {expression}"
        time.sleep(0.05)


def wait_polls(page, n: int = 2, timeout_s: float = 30.0) -> None:
    """Until the page has refreshed `n` more times."""
    wait_until(page, f"Number(document.body.dataset.polls || 0) >= {polls(page) + n}", timeout_s)
