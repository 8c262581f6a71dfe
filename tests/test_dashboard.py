"""`hpipe serve`'s live page in a real browser (headless Chromium through Playwright): on 2 local
stages of the default model, behind --api-key. The page asks for the key and shows nothing
without it; its stages are the plan's; under 8 streaming chats its counters follow /metrics within
one refresh and the busy bars move; its chat box streams the API's own answer; whatever a client,
the model or a host wrote is shown as text and runs nothing. A lost host's event row:
tests/test_ssh.py (the emulated hosts)."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import openai
import pytest

from browser import browser, open_page, page_value, unavailable_reason, wait_polls, wait_until
from hpipe import formats, models
from hpipe.cli import main
from serving import stop_serve
from test_serve import metric, request, start_server

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"a real browser: {REASON}")]

KEY = "dash-key-7"
HOSTILE = ['<script>window.ran = "script"</script>', '<img src=x onerror="window.ran = \'img\'">']


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    plan = tmp / "plan.json"
    assert main(["plan", "--model", "smollm2", "--stages", "2", "-o", str(plan)]) == 0
    proc, base, log = start_server(tmp, plan, key=KEY)
    yield base, formats.load_plan(plan)
    stop_serve(proc)
    assert proc.returncode in (0, 130), log.read_text()


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


def chats(base: str, n: int, max_tokens: int) -> list[threading.Thread]:
    """n streaming chats at once, in threads (started)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def one(i: int) -> None:
        for _ in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": f"Count to {i + 9}."}],
                                                max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}):
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_the_page_asks_for_the_key_and_then_shows_the_plans_stages(served, chromium):
    base, plan = served
    assert request(base, "GET", "/hpipe/state", key=None)[0] == 401
    with urllib.request.urlopen(base + "/", timeout=30) as r:      # the page: its own script alone may run
        policy = r.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in policy and "unsafe" not in policy and "connect-src 'self'" in policy, policy
    page = chromium.new_page()
    page.goto(base + "/")
    page.wait_for_selector("#key", state="visible")
    assert page.locator("#dash").is_hidden() and page.locator("#stages tr").count() == 0
    page.fill("#key", "wrong")
    page.click("#keyform button")
    wait_until(page, "document.getElementById('keywhy').textContent.includes('not accepted')")
    assert page.locator("#dash").is_hidden() and page.locator("#stages tr").count() == 0
    page.close()

    page = open_page(chromium, base, KEY)
    config = models.load_config(models.resolve_model("smollm2").path)
    rows = page.locator("#stages tr")
    assert rows.count() == len(plan.stages) == 2
    for r, stage in enumerate(plan.stages):
        row = rows.nth(r)
        assert row.get_attribute("data-host") == stage.host
        assert row.get_attribute("data-units") == f"{stage.units[0]},{stage.units[1]}"
        assert models.units_text(config, *stage.units) in row.inner_text()
    assert "cut before units [31]" in page.inner_text("#plansum")
    assert page.problems == []
    page.close()


def test_under_load_its_numbers_follow_metrics_and_the_busy_bars_move(served, chromium):
    """8 streaming chats: a counter the page shows lies between /metrics just before and just after
    one refresh; after the load, every counter equals /metrics'; each stage's busy bar rose."""
    base, plan = served
    page = open_page(chromium, base, KEY)
    idle = [float(b or 0) for b in page.eval_on_selector_all("#stages tr", "rows => rows.map(r => r.dataset.busy)")]
    threads = chats(base, 8, 64)
    compared = drawn = 0
    while any(t.is_alive() for t in threads):
        before = metric(base, "hpipe_generation_tokens_total")
        wait_polls(page, 2)          # the second one fetched after `before` was read
        shown = page_value(page, "hpipe_generation_tokens_total")
        after = metric(base, "hpipe_generation_tokens_total")
        assert before <= shown <= after, (before, shown, after)
        compared += 1
        drawn = max(drawn, page.locator("#run rect").count())
    for t in threads:
        t.join()
    assert compared >= 2
    wait_polls(page, 2)
    for name in ("hpipe_generation_tokens_total", "hpipe_prompt_tokens_total", "hpipe_requests_running",
                 "hpipe_requests_waiting", "hpipe_kv_pages_used", "hpipe_kv_pages_free", "hpipe_kv_pages_cached"):
        assert page_value(page, name) == metric(base, name), name
    text = request(base, "GET", "/metrics")[1]
    finished = sum(float(v) for v in re.findall(r'^hpipe_requests_finished_total\{[^}]*\} (\S+)$', text, re.M))
    shown_finished = float(page.locator("#nums div", has_text="finished").locator("dd").get_attribute("data-value"))
    assert shown_finished == finished >= 8
    busy = [float(b or 0) for b in page.eval_on_selector_all("#stages tr", "rows => rows.map(r => r.dataset.busy)")]
    assert all(b > i + 0.02 for b, i in zip(busy, idle)), (idle, busy)
    assert drawn > 0        # the live run chart drew micro-batches while they ran
    assert page.problems == []
    page.close()


def test_a_chat_in_the_page_streams_the_apis_answer(served, chromium):
    base, _ = served
    page = open_page(chromium, base, KEY)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#prompt", "Name a large animal.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-streaming='0']", timeout=120_000)
    shown = page.inner_text(".msg.assistant > span")
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a large animal."}], max_tokens=24, temperature=0,
        top_p=1, stream=True) if ch.choices)
    assert shown == streamed and shown.strip()
    assert page.problems == []
    page.close()


def test_what_clients_the_model_and_hosts_wrote_is_shown_as_text_and_runs_nothing(served, chromium):
    """Hostile text in a prompt, in a streamed answer and in an event (host name, cause): shown
    literally, no element made of it, no script run (the answer and the event come through the
    page's own fetches, rewritten on their way in)."""
    base, _ = served
    page = open_page(chromium, base, KEY)

    def answer(route) -> None:
        chunks = [{"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]} for piece in HOSTILE]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        route.fulfill(status=200, content_type="text/event-stream",
                      body="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    def state(route) -> None:
        st = route.fetch().json()
        st["events"] = [{"kind": "lost", "host": HOSTILE[1], "cause": HOSTILE[0], "t": st["t"], "old_stages": HOSTILE,
                         "new_stages": [HOSTILE[1]], "predicted_old_s": None, "predicted_new_s": None,
                         "phases": {}, "resumed": 0, "outage_s": 1.5, "degraded": HOSTILE[0]}]
        st["health"] = {"status": "degraded", "error": HOSTILE[1]}
        route.fulfill(json=st)

    page.route("**/v1/chat/completions", answer)
    page.route("**/hpipe/state", state)
    page.fill("#prompt", "Say " + HOSTILE[0] + HOSTILE[1])
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-streaming='0']")
    page.wait_for_selector("#events tr[data-kind='lost']")
    wait_polls(page, 1)
    assert page.inner_text(".msg.assistant > span") == "".join(HOSTILE)
    assert page.inner_text(".msg.user > span") == "Say " + "".join(HOSTILE)
    assert HOSTILE[1] in page.inner_text("#events") and HOSTILE[0] in page.inner_text("#events")
    assert HOSTILE[1] in page.inner_text("#banner")
    assert page.evaluate("document.querySelectorAll('main img, main script, #banner *').length") == 0
    assert page.evaluate("window.ran") is None
    assert page.problems == []
    page.close()
