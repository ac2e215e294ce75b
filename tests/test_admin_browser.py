"""The admin "Locks" page in a real headless Chromium (Debian's ``chromium``) driven by
Playwright, against the testproject served by pytest-django's ``live_server`` and three real
embedded Redis nodes.

Another process holds a lock (auto-renewed); the operator logs in, sees it with its holder and
a ticking countdown, force-releases it, sees it gone, and the holder process reports that it
lost the lock. A screenshot of the list goes to ``docs/_static/admin-locks.png`` (used by
docs/admin.rst) when that file is missing or ``REDLOCK_UPDATE_SCREENSHOTS=1``.

No browser is ever downloaded: Chromium comes from ``REDLOCK_CHROMIUM`` or ``PATH``. Without
one the test is skipped, or fails when ``REDLOCK_REQUIRE_ALL=1``.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from django_redlock import Redlock

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = REPO_ROOT / "docs" / "_static" / "admin-locks.png"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LOCK = "nightly-report:2026-05"

HOLDER = """
import sys, time
from django_redlock import LockLost, LockNotOwned, Redlock

rl = Redlock(sys.argv[1].split(","), ttl=60.0)
lock = rl.lock(sys.argv[2], auto_renew=True, fencing=True,
               meta={"task": "reports.tasks.nightly", "task_id": "5f1c-77aa", "user": "ops"})
if not lock.acquire(blocking=False):
    print("NOT ACQUIRED", flush=True)
    sys.exit(1)
print("ACQUIRED", lock.token, flush=True)
deadline = time.monotonic() + 120
checked = time.monotonic()
while time.monotonic() < deadline:
    # The watchdog's renewal notices a force release; check() asks the nodes directly.
    if lock.lost or (time.monotonic() - checked > 0.5 and not lock.check()):
        break
    if time.monotonic() - checked > 0.5:
        checked = time.monotonic()
    time.sleep(0.05)
else:
    print("STILL HELD", flush=True)
    sys.exit(2)
try:
    lock.release()
except LockLost as exc:
    print("LOST", type(exc).__name__, exc, flush=True)
except LockNotOwned as exc:
    print("LOST", type(exc).__name__, exc, flush=True)
else:
    print("RELEASED NORMALLY", flush=True)
"""


def _chromium() -> str:
    path = os.environ.get("REDLOCK_CHROMIUM") or shutil.which("chromium")
    if not path:
        reason = (
            "no Chromium: install Debian's `chromium` package or set REDLOCK_CHROMIUM "
            "to a Chromium binary (no browser is downloaded)"
        )
        if os.environ.get("REDLOCK_REQUIRE_ALL") == "1":
            pytest.fail(reason + " (REDLOCK_REQUIRE_ALL=1)")
        pytest.skip(reason)
    return path


@pytest.fixture
def browser_page(monkeypatch) -> Iterator:
    executable = _chromium()
    # Playwright's sync API keeps an asyncio loop on this thread; Django's guard would take
    # the test's own (synchronous) ORM calls for calls from async code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - playwright is in the test extra
        if os.environ.get("REDLOCK_REQUIRE_ALL") == "1":
            pytest.fail("playwright is not installed (REDLOCK_REQUIRE_ALL=1)")
        pytest.skip("playwright is not installed (pip install playwright)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                viewport={"width": 1440, "height": 860}, timezone_id="UTC", locale="en-US"
            )
            page = context.new_page()
            page.set_default_timeout(30_000)
            yield page
            context.close()
        finally:
            browser.close()


class Holder:
    """A lock held by another Python process, which reports what happens to it on stdout."""

    def __init__(self, urls: list[str], name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLDER), ",".join(urls), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def expect(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"holder never printed {prefix!r}; output: {''.join(self.output)!r}"
                ) from None
            if line.startswith(prefix):
                return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _luminance(css_color: str) -> float:
    r, g, b = (int(x) for x in re.findall(r"\d+", css_color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_operator_force_releases_a_lock_held_by_another_process(
    browser_page,
    live_server,
    admin_redlock_settings,
    redis_nodes,
    django_user_model,
    transactional_db,
    tmp_path,
):
    from django.contrib.admin.models import LogEntry

    admin_redlock_settings.REDLOCK = {**admin_redlock_settings.REDLOCK, "STUCK_AFTER": 3600}
    django_user_model.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    urls = list(redis_nodes.urls)
    # Some company for the screenshot: a view's lock and a split leftover.
    neighbour = Redlock(urls, ttl=45.0)
    view_lock = neighbour.lock(
        "invoice:42",
        meta={
            "view": "shop.views.pay_invoice",
            "method": "POST",
            "path": "/invoices/42/pay/",
            "user": "alice",
        },
    )
    assert view_lock.acquire()
    with redis_nodes[0].client(socket_timeout=5) as c:
        now_ms = int(time.time() * 1000)
        c.hset(
            "redlock:lock:import:catalog",
            mapping={
                "token": "a1b2c3",
                "meta": '{"host": "worker-7", "pid": 4242, "thread": "MainThread"}',
                "fence": 0,
                "renewals": 0,
                "acquired": now_ms - 95_000,
                "ttl": 120_000,
            },
        )
        c.pexpire("redlock:lock:import:catalog", 25_000)

    holder = Holder(urls, LOCK)
    try:
        token = holder.expect("ACQUIRED").split()[1]
        page = browser_page
        base = live_server.url + "/admin/django_redlock/lock/"

        page.goto(live_server.url + "/admin/login/?next=/admin/django_redlock/lock/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", "s3cret-pw")
        page.click("input[type=submit]")
        page.wait_for_url(base)

        row = page.locator(f'tr[data-key="{LOCK}"]')
        row.wait_for()
        holder_text = row.locator("td.field-holder").inner_text()
        assert f":{holder.proc.pid}" in holder_text
        assert "task id 5f1c-77aa" in holder_text and "task reports.tasks.nightly" in holder_text
        assert "user ops" in holder_text
        assert row.locator("td.field-nodes").inner_text() == "3/3"
        # The countdown ticks down in the page, without a reload.
        ttl_cell = row.locator("td.field-ttl")
        first = ttl_cell.inner_text()
        page.wait_for_function(
            "([sel, text]) => document.querySelector(sel).textContent !== text",
            arg=[f'tr[data-key="{LOCK}"] td.field-ttl', first],
        )
        assert re.fullmatch(r"\d+( min \d+)? s", ttl_cell.inner_text().strip())
        # The split leftover is flagged; its highlight follows the admin theme (dark mode).
        leftover = page.locator('tr[data-key="import:catalog"]')
        assert "split" in leftover.locator(".redlock-flag").inner_text()
        cell = leftover.locator("td.field-holder")
        light = cell.evaluate("el => getComputedStyle(el).backgroundColor")
        page.emulate_media(color_scheme="dark")
        dark = cell.evaluate("el => getComputedStyle(el).backgroundColor")
        assert _luminance(light) > 0.8 > 0.3 > _luminance(dark), (light, dark)
        page.emulate_media(color_scheme="light")

        if page.locator("#toggle-nav-sidebar").count():  # more room for the table
            page.click("#toggle-nav-sidebar")
        # The docs' copy is written when missing or on request (it changes on every run:
        # times, ports, pids); otherwise the shot goes to the test's tmp dir.
        shot = tmp_path / "admin-locks.png"
        if os.environ.get("REDLOCK_UPDATE_SCREENSHOTS") == "1" or not SCREENSHOT.exists():
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shot = SCREENSHOT
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000

        # Select it, confirm, release.
        row.locator("input.redlock-select").check()
        page.click("#redlock-release-selected")
        page.wait_for_url(base + "release/")
        confirm = page.locator("#redlock-release-list")
        assert LOCK in confirm.inner_text()
        assert token == page.locator('input[name="token"]').get_attribute("value")
        page.click("#redlock-confirm-release")
        page.wait_for_url(base)
        assert (
            f"Force-released 1 lock: “{LOCK}” (3/3 nodes)."
            in page.locator("ul.messagelist").inner_text()
        )
        assert page.locator(f'tr[data-key="{LOCK}"]').count() == 0
        assert page.locator('tr[data-key="invoice:42"]').count() == 1

        lost = holder.expect("LOST")
        assert "LockLost" in lost, holder.output
        assert holder.proc.wait(timeout=30) == 0
    finally:
        holder.stop()
        view_lock.release()
        neighbour.close()

    for node in redis_nodes:
        with node.client(socket_timeout=5) as c:
            assert not c.exists(f"redlock:lock:{LOCK}")
    entry = LogEntry.objects.get(object_id=LOCK)
    assert entry.user.username == "operator"
    assert "task_id='5f1c-77aa'" in entry.change_message
    assert f"pid={holder.proc.pid}" in entry.change_message
