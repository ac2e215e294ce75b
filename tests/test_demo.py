"""The demo (README command 1) run as a user runs it: ``python -m django_redlock.demo`` in a
subprocess, with real redis-server nodes, a real web server and a real Celery worker.

Leftovers are found two ways: every process the demo starts inherits a marker in its
environment (redis-servers and the Celery worker run in sessions of their own, so the process
group alone would miss them), and the demo's own process group must be empty. Its temp folders
go to a private TMPDIR that must be empty afterwards. Signals are sent when the demo prints the
line of the moment under test, never after a sleep.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from django_redlock.testing import _reap_with_owner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER_VAR = "REDLOCK_DEMO_TEST_RUN"
#: Everything must be gone this long after the signal.
GRACE = 2.0


def _proc_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:  # gone meanwhile, or not ours
        return b""


def _pgid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return None if fields[0] == b"Z" else int(fields[2])  # a zombie is already dead


class Demo:
    """The demo as a subprocess in its own process group, its output read line by line."""

    def __init__(self, *args: str) -> None:
        self.marker = uuid.uuid4().hex
        # Short: the nodes' unix-socket-safe temp dirs must fit under it.
        self.tmp = Path(tempfile.mkdtemp(prefix="demo-t-", dir="/tmp"))
        env = {**os.environ, "TMPDIR": str(self.tmp), MARKER_VAR: self.marker}
        env.pop("REDLOCK_NODES", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "django_redlock.demo", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        # Out of reach of a signal to the test run's group: the nodes' reaper kills the demo's
        # group if the test run ends without its cleanup (the demo's own reaper then stops
        # what the demo started).
        _reap_with_owner(self.proc.pid, group=True)
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    @property
    def text(self) -> str:
        return "\n".join(self.output)

    def wait_for(self, pattern: str, timeout: float = 150) -> re.Match[str]:
        """The first line (from here on) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}:\n{self.text}") from None
            if line is None:
                raise AssertionError(f"the demo ended before {pattern!r}:\n{self.text}")
            self.output.append(line)
            match = re.search(pattern, line)
            if match:
                return match

    def finish(self, timeout: float = 300) -> int:
        """Wait for the exit and the rest of the output."""
        code = self.proc.wait(timeout)
        while (line := self._lines.get(timeout=10)) is not None:
            self.output.append(line)
        return code

    def leftovers(self) -> list[str]:
        """Processes the demo started that still exist, and files left in its TMPDIR."""
        needle = f"{MARKER_VAR}={self.marker}".encode()
        found = []
        for pid in _proc_pids():
            group = _pgid(pid)
            if group is None:
                continue
            if group == self.proc.pid or needle in _read(f"/proc/{pid}/environ").split(b"\0"):
                cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
                found.append(f"pid {pid}: {cmd}")
        found += [f"file {p}" for p in self.tmp.iterdir()]
        return found

    def assert_cleaned_up_by(self, deadline: float) -> None:
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"left behind {time.monotonic() - deadline + GRACE:.1f}s after: {left}"

    def kill_everything(self) -> None:
        """Test teardown: whatever a failed test left is killed, so the run goes on clean."""
        needle = f"{MARKER_VAR}={self.marker}".encode()
        for pid in _proc_pids():
            if _pgid(pid) == self.proc.pid or needle in _read(f"/proc/{pid}/environ"):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def demo():
    """``demo(*args) -> Demo``, started; everything it started is killed at teardown."""
    made: list[Demo] = []

    def start(*args: str) -> Demo:
        made.append(Demo(*args))
        return made[-1]

    yield start
    for run in made:
        run.kill_everything()


# --------------------------------------------------------------------------- --no-serve


# 1 and 2 nodes have no node to spare, 3 one; 5 (two to spare) runs with the fault scenarios.
@pytest.mark.parametrize("nodes", [1, 2, 3, pytest.param(5, marks=pytest.mark.faults)])
def test_tour_runs_on_any_number_of_nodes_and_says_so(demo, nodes):
    run = demo("--no-serve", "--nodes", str(nodes))
    assert run.finish() == 0, run.text
    text = run.text
    quorum = nodes // 2 + 1
    assert re.search(rf"Started {nodes} (redis|valkey)-server \d+\.\d+", text), text
    assert f"Node failures: {nodes} node{'s' if nodes > 1 else ''}, quorum {quorum}:" in text
    assert f"{nodes - quorum + 1} of {nodes} nodes down: refused, as it must be" in text
    if nodes - quorum:  # nodes that may fail: frozen, and the lock is still granted
        assert f"{nodes - quorum} of {nodes} nodes frozen (SIGSTOP): acquired" in text
    assert re.search(r"locks work.*: acquired after", text)
    assert "counter = 200 of 200" in text
    assert "rejected by the storage" in text
    # The whole 423 answer, not cut mid-word.
    assert re.search(
        r"second: 423, Retry-After: \d+s, body: This resource is being modified by another "
        r"request; try again later\.",
        text,
    )
    assert "Tour: every step as promised" in text
    assert "Traceback" not in text
    assert not run.leftovers()


def test_bad_node_count_is_refused_with_a_clear_message(demo):
    run = demo("--no-serve", "--nodes", "0")
    assert run.finish() == 2
    assert "at least one node is needed, got 0" in run.text
    assert not run.leftovers()


# --------------------------------------------------------------------------- stop signals

# (signal, extra arguments, the line that marks the moment): every signal where the tour
# freezes a child with SIGSTOP, and each signal at other moments of the tour and of serving.
# The README command runs every signal once and every moment of the tour once (serving ends
# by SIGINT in test_serving_shows_...); the moments of serving, each of which starts a Celery
# worker, and the same moment under another signal (one handler serves all three) run with
# the fault scenarios.
_AGAIN = pytest.mark.faults
TOUR_MOMENTS = [
    (signal.SIGINT, [], r"^Started \d+ (redis|valkey)-server"),
    (signal.SIGTERM, [], r"with the lock   : running"),
    (signal.SIGINT, ["--nodes", "5"], r"nodes frozen \(SIGSTOP\)"),
    (signal.SIGHUP, ["--nodes", "2"], r"short of the quorum: waiting"),
    (signal.SIGINT, [], r"froze \(SIGSTOP\) before writing", _AGAIN),
    (signal.SIGTERM, [], r"froze \(SIGSTOP\) before writing", _AGAIN),
    (signal.SIGHUP, [], r"froze \(SIGSTOP\) before writing"),
    (signal.SIGTERM, [], r"GET .* twice at once"),
]
# The last moment is also where test_serving_shows_... ends the demo with SIGINT.
SERVE_MOMENTS = [
    (signal.SIGHUP, r"starting a Celery worker"),
    (signal.SIGINT, r"sent; each run holds"),
    (signal.SIGTERM, r"^Press Ctrl-C to stop", _AGAIN),
]


@pytest.mark.parametrize(
    ("signum", "args", "moment"),
    [
        pytest.param(s, a, m, id=f"{s.name}-{m[:24]}", marks=marks)
        for s, a, m, *marks in TOUR_MOMENTS
    ],
)
def test_a_stop_signal_during_the_tour_leaves_nothing_behind(demo, signum, args, moment):
    run = demo("--no-serve", *args)
    run.wait_for(moment)
    assert run.leftovers(), "the demo should be running something now"
    sent = time.monotonic()
    run.proc.send_signal(signum)
    run.assert_cleaned_up_by(sent + GRACE)
    assert run.finish(timeout=max(0.1, sent + GRACE - time.monotonic())) == 128 + signum
    assert f"{signum.name}: stopping everything" in run.text


@pytest.mark.faults
@pytest.mark.celery
@pytest.mark.parametrize(
    ("signum", "moment"),
    [pytest.param(s, m, id=f"{s.name}-{m[:24]}", marks=marks) for s, m, *marks in SERVE_MOMENTS],
)
def test_a_stop_signal_while_serving_leaves_nothing_behind(demo, signum, moment):
    run = demo("--port", "0")
    run.wait_for(moment)
    sent = time.monotonic()
    run.proc.send_signal(signum)
    run.assert_cleaned_up_by(sent + GRACE)
    code = run.finish(timeout=max(0.1, sent + GRACE - time.monotonic()))
    # Ctrl-C is how serving ends (0); before that it interrupts the demo.
    assert code == (0 if moment.startswith("^Press") else 128 + signum), run.text


# A SIGKILLed demo (an OOM kill alike) runs no handler: the reaper it started, which outlives
# it, removes everything, a frozen child and the Celery worker's whole pool included.
KILL_MOMENTS = [
    pytest.param(["--no-serve"], r"froze \(SIGSTOP\) before writing", id="tour-frozen-child"),
    pytest.param(
        ["--port", "0"], r"^Press Ctrl-C to stop", id="serving", marks=[pytest.mark.celery, _AGAIN]
    ),
]


@pytest.mark.parametrize(("args", "moment"), KILL_MOMENTS)
def test_sigkill_leaves_nothing_behind(demo, args, moment):
    run = demo(*args)
    run.wait_for(moment)
    assert run.leftovers(), "the demo should be running something now"
    sent = time.monotonic()
    run.proc.kill()
    run.assert_cleaned_up_by(sent + GRACE)
    assert run.finish(timeout=10) == -signal.SIGKILL


# --------------------------------------------------------------------------- serving


class Browser:
    """Real HTTP with cookies and the admin's CSRF token, as a browser would send it."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )

    def get(self, path: str) -> tuple[int, str, str]:
        with self.opener.open(self.base + path, timeout=15) as response:
            return response.status, response.url, response.read().decode()

    def post(self, path: str, fields: dict[str, str]) -> tuple[int, str, str]:
        data = urllib.parse.urlencode(fields).encode()
        with self.opener.open(self.base + path, data, timeout=15) as response:
            return response.status, response.url, response.read().decode()


@pytest.mark.celery
def test_serving_shows_celery_serialization_and_the_stuck_lock_in_the_admin(demo):
    run = demo("--port", "0", "--nodes", "3")
    admin = run.wait_for(r"admin locks:\s+(http://\S+)").group(1)
    login = run.wait_for(r"login:\s+user (\S+)\s+password (\S+)")
    stuck = run.wait_for(r"stuck lock:\s+(\S+)").group(1)
    run.wait_for(r"^Press Ctrl-C to stop")
    text = run.text

    # Celery: each key's three runs one after another, the two keys side by side.
    for key in ("account-1", "account-2"):
        for number in (1, 2, 3):
            assert re.search(rf"finished {key} #{number}\s+in worker pid \d+", text)
            assert re.search(rf"^\s+{key} #{number}\s+\|[ #]+\|$", text, re.M)
    assert "same key: never overlapped" in text
    assert "different keys: ran in parallel" in text

    # The admin over real HTTP, logged in with the printed credentials.
    base, path = admin.split("/admin/", 1)
    browser = Browser(base)
    status, _, page = browser.get(f"/admin/login/?next=/admin/{path}")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert status == 200 and token, page[:2000]
    status, url, page = browser.post(
        f"/admin/login/?next=/admin/{path}",
        {
            "csrfmiddlewaretoken": token.group(1),
            "username": login.group(1),
            "password": login.group(2),
            "next": f"/admin/{path}",
        },
    )
    assert status == 200 and url == admin, f"login failed: {url}\n{page[:2000]}"
    assert stuck in page
    row = page[page.index(stuck) : page.index(stuck) + 3000]
    assert "holder gone" in row, row
    status, _, page = browser.get(f"/admin/{path}nodes/")
    assert status == 200 and "3 of 3 nodes reachable, quorum 2" in page, page[:3000]
    # The project's @locked view answers (nothing holds its key).
    status, _, body = browser.get("/orders/7/pay/")
    assert status == 200 and '"lock": "order:7"' in body

    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    run.assert_cleaned_up_by(sent + GRACE)
    assert run.finish(timeout=max(0.1, sent + GRACE - time.monotonic())) == 0, run.text
    assert "Traceback" not in run.text
