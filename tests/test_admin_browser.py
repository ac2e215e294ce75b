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

import django
import pytest

from django_redlock import Redlock
from django_redlock.core.commands import lock_value

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


@pytest.fixture(scope="module")
def _browser() -> Iterator:
    """One Chromium for the module (a launch per test cost about a second and a half on a
    busy host); each test gets a context of its own, so no cookie or page outlives it."""
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - playwright is in the test extra
        if os.environ.get("REDLOCK_REQUIRE_ALL") == "1":
            pytest.fail("playwright is not installed (REDLOCK_REQUIRE_ALL=1)")
        pytest.skip("playwright is not installed (pip install playwright)")
    # Playwright's sync API keeps an asyncio loop on this thread while it runs; Django's
    # guard would take the tests' own (synchronous) ORM calls for calls from async code.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            try:
                yield browser
            finally:
                browser.close()


@pytest.fixture
def browser_page(_browser) -> Iterator:
    context = _browser.new_context(
        viewport={"width": 1440, "height": 860}, timezone_id="UTC", locale="en-US"
    )
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        yield page
    finally:
        context.close()


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


def log_in(page, live_server) -> str:
    """Log the superuser ``operator`` in; returns the lock list's URL, where it lands."""
    base = live_server.url + "/admin/django_redlock/lock/"
    page.goto(live_server.url + "/admin/login/?next=/admin/django_redlock/lock/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    page.wait_for_url(base)
    return base


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
        value = lock_value(
            "a1b2c3",
            ttl_ms=120_000,
            meta_json='{"host": "worker-7", "pid": 4242, "thread": "MainThread"}',
            acquired_ms=now_ms - 95_000,
        )
        c.set("redlock:lock:import:catalog", value, px=25_000)

    holder = Holder(urls, LOCK)
    try:
        token = holder.expect("ACQUIRED").split()[1]
        page = browser_page
        base = log_in(page, live_server)

        row = page.locator(f'tr[data-key="{LOCK}"]')
        row.wait_for()
        holder_text = row.locator("td.field-holder").inner_text()
        assert f":{holder.proc.pid}" in holder_text
        assert "task id 5f1c-77aa" in holder_text and "task reports.tasks.nightly" in holder_text
        assert "user ops" in holder_text
        # On a loaded host a holder may hold on a quorum only (a node whose answer was too
        # late is undone there): 2 or 3 of 3, as the nodes report it.
        assert re.fullmatch(r"[23]/3", row.locator("td.field-nodes").inner_text())
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


LAYOUT_SHOTS = {
    1280: REPO_ROOT / "docs" / "_static" / "admin-locks-1280.png",
    390: REPO_ROOT / "docs" / "_static" / "admin-locks-phone.png",
}


def _page_overflow(page) -> tuple[int, int, list[str]]:
    """The page's scroll width, its viewport width and the elements reaching past it (none of
    them inside a box that scrolls on its own: that is where wide tables go on a phone)."""
    return page.evaluate(
        """() => {
            const viewport = document.documentElement.clientWidth;
            const scrolls = el => {
                for (let box = el.parentElement; box; box = box.parentElement) {
                    const x = getComputedStyle(box).overflowX;
                    if ((x === "auto" || x === "scroll") && box.scrollWidth > box.clientWidth) {
                        return true;
                    }
                }
                return false;
            };
            const past = [];
            for (const el of document.querySelectorAll("body *")) {
                const r = el.getBoundingClientRect();
                if (r.width > 0 && r.right > viewport + 0.5 && !scrolls(el)) {
                    past.push(`${el.tagName}#${el.id}.${el.className} ${Math.round(r.right)}`);
                }
            }
            return [document.documentElement.scrollWidth, viewport, past.slice(0, 10)];
        }"""
    )


@pytest.mark.parametrize("width", [1400, 1280, 390])
def test_list_fits_desktop_widths_and_scrolls_on_a_phone(
    browser_page,
    live_server,
    admin_redlock_settings,
    redis_nodes,
    django_user_model,
    tmp_path,
    transactional_db,
    width,
):
    """Every column (Fence last) is inside the window at 1400 and 1280 px; on a phone the
    table scrolls inside its own box and the page itself never scrolls sideways. The same for
    every page of ours (node health, lock detail, release confirmation), on the Django this
    runs under (CI runs it under each supported Django line)."""
    django_user_model.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    rl = Redlock(list(redis_nodes.urls), ttl=60.0)
    locks = [
        rl.lock(
            f"nightly-report:2026-05:customer-{i:04d}:region-eu-west",
            fencing=True,
            meta={
                "task": "reports.tasks.nightly_customer_report",
                "task_id": f"5f1c77aa-0c2b-4d7e-9a51-{i:012d}",
                "worker": "celery@worker-eu-west-1.internal.example.com",
                "view": "shop.views.pay_invoice",
                "user": "alice@example.com",
            },
        )
        for i in range(3)
    ]
    for lock in locks:
        assert lock.acquire()
    try:
        page = browser_page
        page.set_viewport_size({"width": width, "height": 900})
        base = log_in(page, live_server)
        page.locator("#result_list").wait_for()
        # The page never scrolls sideways, and nothing sticks out of it.
        scroll_width, viewport, past = _page_overflow(page)
        assert scroll_width <= viewport and not past, (django.get_version(), past)
        fence = page.locator("th.column-fence")
        box = fence.bounding_box()
        assert box is not None
        shot = tmp_path / f"admin-{width}.png"
        target = LAYOUT_SHOTS.get(width)
        if target is not None and (
            os.environ.get("REDLOCK_UPDATE_SCREENSHOTS") == "1" or not target.exists()
        ):
            shot = target
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 5_000
        search = page.locator("#searchbar").bounding_box()
        assert search is not None and search["width"] >= 120  # usable on a phone too
        results = page.locator("#changelist .results")
        if width >= 1280:
            # Nothing hidden behind the table box's own scrolling either.
            inner = results.evaluate("el => [el.scrollWidth, el.clientWidth]")
            assert inner[0] <= inner[1], inner
            edge = results.evaluate("el => el.getBoundingClientRect().right")
            assert box["x"] + box["width"] <= min(edge, viewport) + 0.5, (box, edge, viewport)
        else:
            # The table scrolls in its own box: scrolled to the end, Fence is in view.
            assert results.evaluate("el => getComputedStyle(el).overflowX") in ("auto", "scroll")
            results.evaluate("el => { el.scrollLeft = el.scrollWidth; }")
            box = fence.bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= viewport
        # Every other page of ours fits the same window.
        name = locks[0].name
        for url in (
            f"{base}nodes/",
            f"{base}detail/?name={name}",
            f"{base}release/?name={name}",
        ):
            page.goto(url)
            page.locator("#content-main").wait_for()
            scroll_width, viewport, past = _page_overflow(page)
            assert scroll_width <= viewport and not past, (django.get_version(), url, past)
        # The detail page's title (the long key) wraps inside the window.
        page.goto(f"{base}detail/?name={name}")
        title = page.locator("h1 .redlock-key").bounding_box()
        assert title is not None and title["x"] + title["width"] <= viewport + 0.5, title
        # A key with a long unbroken run (a digest, as @locked's long keys end) wraps too,
        # in the title and in the breadcrumb, on the detail and the release pages.
        digest = rl.lock(f"upload:{'0123456789abcdef' * 4}", ttl=60.0)
        assert digest.acquire()
        locks.append(digest)
        for url in (f"{base}detail/?name={digest.name}", f"{base}release/?name={digest.name}"):
            page.goto(url)
            page.locator("#content-main").wait_for()
            scroll_width, viewport, past = _page_overflow(page)
            assert scroll_width <= viewport and not past, (django.get_version(), url, past)
    finally:
        for lock in locks:
            lock.release()
        rl.close()


def test_operator_switches_to_the_database_backend_and_force_releases(
    browser_page,
    live_server,
    admin_redlock_settings,
    redis_nodes,
    django_user_model,
    transactional_db,
):
    """The lock-service selector: the operator switches from the Redlock to the database
    backend, sees its locks with their holders and stuck flags, and force-releases one
    through the confirmation page; the holder's lock is gone, its neighbour stays."""
    from django.contrib.admin.models import LogEntry

    from django_redlock.backends.database import DatabaseLocks
    from tests.backends.cases import dead_pid

    admin_redlock_settings.REDLOCK = {
        **admin_redlock_settings.REDLOCK,
        "STUCK_AFTER": 3600,
        "BACKENDS": {
            "db": {
                "BACKEND": "django_redlock.backends.database.DatabaseLocks",
                "OPTIONS": {"using": "default"},
            }
        },
    }
    django_user_model.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    redis_lock = Redlock(list(redis_nodes.urls), ttl=60.0)
    on_redis = redis_lock.lock("redis-only:1")
    holder = DatabaseLocks("default")  # connections of its own, like another worker
    report = holder.lock("db:report", ttl=60, meta={"task": "reports.nightly", "user": "ops"})
    orphan = holder.lock("db:orphan", ttl=60, meta={"pid": dead_pid()})
    assert on_redis.acquire(blocking=False)
    assert report.acquire(blocking=False) and orphan.acquire(blocking=False)
    try:
        page = browser_page
        base = log_in(page, live_server)
        page.locator('tr[data-key="redis-only:1"]').wait_for()  # the default: the Redlock
        assert page.locator('tr[data-key="db:report"]').count() == 0
        page.click('#redlock-backends a:text-is("db")')
        page.wait_for_url(base + "?using=db")
        assert page.locator("#redlock-backends strong").inner_text() == "db"
        row = page.locator('tr[data-key="db:report"]')
        row.wait_for()
        assert page.locator('tr[data-key="redis-only:1"]').count() == 0
        holder_text = row.locator("td.field-holder").inner_text()
        assert f":{os.getpid()}" in holder_text and "task reports.nightly" in holder_text
        assert row.locator(".redlock-flag").count() == 0
        gone = page.locator('tr[data-key="db:orphan"] .redlock-flag')
        assert gone.inner_text() == "holder gone"
        assert row.locator("td.field-nodes").inner_text() == "1/1"

        row.locator("input.redlock-select").check()
        page.click("#redlock-release-selected")
        page.wait_for_url(base + "release/")
        assert "db:report" in page.locator("#redlock-release-list").inner_text()
        assert report.token == page.locator('input[name="token"]').get_attribute("value")
        page.click("#redlock-confirm-release")
        page.wait_for_url(base)  # back on the list, still on the database backend
        assert (
            "Force-released 1 lock: “db:report” (1/1 nodes)."
            in page.locator("ul.messagelist").inner_text()
        )
        assert page.locator("#redlock-backends strong").inner_text() == "db"
        assert page.locator('tr[data-key="db:report"]').count() == 0
        assert page.locator('tr[data-key="db:orphan"]').count() == 1
        assert not report.check() and orphan.check() and on_redis.check()

        # The node page, still on the database: named for it, only the columns its health()
        # fills in, the lock count the list shows, at a desktop width and on a phone.
        for width in (1440, 390):
            page.set_viewport_size({"width": width, "height": 860})
            page.goto(f"{base}nodes/")
            page.locator("#redlock-health").wait_for()
            assert page.locator("#content h1").inner_text() == "Database"
            assert page.locator("#redlock-health th").all_text_contents() == [
                "Database",
                "Reachable",
                "Latency",
                "Software",
                "Locks",
                "Clock offset",
            ]
            assert page.locator('#redlock-health td[data-col="locks"]').inner_text() == "1"
            assert "Redis" not in page.locator("#content-main").inner_text()
            scroll_width, viewport, past = _page_overflow(page)
            assert scroll_width <= viewport and not past, (width, past)
    finally:
        for lock in (orphan, on_redis):
            if lock.held:
                lock.release()
        holder.close()
        redis_lock.close()
    assert LogEntry.objects.get(object_id="db:report").user.username == "operator"
