"""Two truly concurrent requests to the testproject served by a real threaded WSGI server.

The server (wsgiref + ThreadingMixIn: one thread per request) runs in this process, so the
views' gates (testproject.views.gate) and Django signals are shared with the test. Every
synchronisation is on an event (a gate's arrivals, a request thread blocked in acquire), never
on a sleep.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from django.core.handlers.wsgi import WSGIHandler

from django_redlock.signals import lock_acquired
from testproject.views import gate

pytestmark = pytest.mark.usefixtures("redlock_settings")

TIMEOUT = 30


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def server(settings):
    settings.TESTPROJECT_GATES = True
    httpd = make_server(
        "127.0.0.1", 0, WSGIHandler(), server_class=_Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield httpd.server_address
    httpd.shutdown()
    httpd.server_close()
    thread.join(TIMEOUT)


def fetch(address, path, barrier=None):
    """GET path; returns (status, headers, body). Waits on ``barrier`` right before sending."""
    conn = http.client.HTTPConnection(*address, timeout=TIMEOUT)
    try:
        if barrier is not None:
            barrier.wait(TIMEOUT)
        conn.request("GET", path, headers={"Accept": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def fire_two(address, path_a, path_b):
    """Start both requests at the same instant (a barrier); returns the two futures."""
    barrier = threading.Barrier(2)
    pool = ThreadPoolExecutor(2)
    futures = [
        pool.submit(fetch, address, path_a, barrier),
        pool.submit(fetch, address, path_b, barrier),
    ]
    pool.shutdown(wait=False)
    return futures


def threads_blocked_in_acquire() -> int:
    """How many threads are inside ``Lock.acquire`` right now (waiting for a lock)."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "acquire" and code.co_filename.endswith(
                ("core/lock.py", "core\\lock.py")
            ):
                count += 1
                break
            frame = frame.f_back
    return count


def wait_until(condition, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


def test_same_key_without_wait_one_200_one_423(server):
    g = uuid.uuid4().hex
    path = f"/orders/1/pay/?gate={g}"
    futures = fire_two(server, path, path)
    # the loser answers while the winner is still inside its critical section
    done, _ = wait(futures, timeout=TIMEOUT, return_when=FIRST_COMPLETED)
    loser = done.pop().result()
    assert gate(g).wait_arrivals(1, TIMEOUT)
    assert gate(g).arrived == 1
    gate(g).open()
    results = sorted([f.result(TIMEOUT) for f in futures], key=lambda r: r[0])
    (ok, _, body), (refused, headers, refused_body) = results
    assert (ok, refused) == (200, 423)
    assert loser[0] == 423
    assert int(headers["Retry-After"]) >= 1
    assert json.loads(refused_body)["error"] == "locked"
    assert json.loads(body)["lock"] == "order:1"


def test_same_key_with_wait_runs_one_after_the_other(server):
    g = uuid.uuid4().hex
    acquired = []

    def record(sender, name, waited, **kwargs):
        if name == "order:2":
            acquired.append(waited)

    lock_acquired.connect(record)
    try:
        path = f"/orders/2/pay-wait/?gate={g}"
        futures = fire_two(server, path, path)
        assert gate(g).wait_arrivals(1, TIMEOUT)  # the first is inside...
        wait_until(lambda: threads_blocked_in_acquire() >= 1)  # ...the second waits for it
        assert gate(g).arrived == 1
        opened_at = time.monotonic()
        gate(g).open()
        results = [f.result(TIMEOUT) for f in futures]
    finally:
        lock_acquired.disconnect(record)
    assert [r[0] for r in results] == [200, 200]
    first, second = sorted((json.loads(r[2]) for r in results), key=lambda d: d["start"])
    assert first["end"] <= second["start"], "critical sections overlapped"
    assert first["start"] < opened_at <= second["start"]
    assert len(acquired) == 2


def test_different_keys_run_in_parallel(server):
    g = uuid.uuid4().hex
    futures = fire_two(server, f"/orders/3/pay/?gate={g}", f"/orders/4/pay/?gate={g}")
    # both are inside their critical sections at the same time
    assert gate(g).wait_arrivals(2, TIMEOUT)
    gate(g).open()
    results = [f.result(TIMEOUT) for f in futures]
    assert [r[0] for r in results] == [200, 200]
    a, b = (json.loads(r[2]) for r in results)
    assert {a["lock"], b["lock"]} == {"order:3", "order:4"}
    assert a["start"] < b["end"] and b["start"] < a["end"], "did not overlap"


def test_class_based_view_same_key(server):
    g = uuid.uuid4().hex
    path = f"/invoices/9/?gate={g}"
    futures = fire_two(server, path, path)
    done, _ = wait(futures, timeout=TIMEOUT, return_when=FIRST_COMPLETED)
    assert done.pop().result()[0] == 423
    assert gate(g).wait_arrivals(1, TIMEOUT)
    gate(g).open()
    assert sorted(f.result(TIMEOUT)[0] for f in futures) == [200, 423]


def test_streaming_holds_the_lock_until_the_stream_ends(server):
    g = uuid.uuid4().hex
    first = ThreadPoolExecutor(1).submit(fetch, server, f"/exports/big.csv?gate={g}")
    assert gate(g).wait_arrivals(1, TIMEOUT)  # headers sent, stream paused mid-way
    status, headers, _ = fetch(server, "/exports/big.csv")
    assert status == 423 and int(headers["Retry-After"]) >= 1
    gate(g).open()
    status, _, body = first.result(TIMEOUT)
    assert status == 200 and body.count(b"\r\n") == 4
    assert fetch(server, "/exports/big.csv")[0] == 200


@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume asynchronous iterators")
@pytest.mark.parametrize("path", ["/renewed-exports/big.csv", "/renewed-async-exports/big.csv"])
def test_an_async_view_s_renewed_lock_holds_until_its_stream_ends_under_wsgi(server, path):
    """Under a WSGI server an async view runs in a loop that ends when it returns; its
    ``auto_renew`` lease (1 s) must outlive that loop while the stream goes on (it was
    renewed from that loop alone, ran out mid-stream, and a second request got in)."""
    g = uuid.uuid4().hex
    first = ThreadPoolExecutor(1).submit(fetch, server, f"{path}?gate={g}")
    assert gate(g).wait_arrivals(1, TIMEOUT)  # the view returned: its loop is gone
    # What is under test is time passing: two and a half leases with the stream paused.
    time.sleep(2.5)
    assert fetch(server, path)[0] == 423
    gate(g).open()
    status, _, body = first.result(TIMEOUT)
    assert status == 200 and body.count(b"\r\n") == 2
    assert fetch(server, path)[0] == 200


# --------------------------------------------------------------------------- ASGI disconnect


def test_asgi_streaming_releases_when_the_client_disconnects(settings):
    """Django's ASGI handler learns of an ``http.disconnect`` while it streams an async
    iterator and cancels the response: the lock is released then, not when the generator
    would have ended (its gate is still closed here). A sync iterator under ASGI is consumed
    whole before the first byte is sent (Django's own rule), so no disconnect reaches it:
    docs/usage.rst says so."""
    import asyncio

    import django
    from django.core.handlers.asgi import ASGIHandler

    from django_redlock import get_redlock

    settings.TESTPROJECT_GATES = True
    g = uuid.uuid4().hex
    path = "/async-exports/gone.csv"

    async def scenario() -> tuple[bool, bool]:
        inbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "http.request", "body": b"", "more_body": False})
        first_chunk = asyncio.Event()

        async def receive():
            return await inbox.get()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": f"gate={g}".encode(),
            "headers": [(b"host", b"testserver")],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        served = asyncio.create_task(ASGIHandler()(scope, receive, send))
        await asyncio.wait_for(first_chunk.wait(), TIMEOUT)
        held_while_streaming = await asyncio.to_thread(get_redlock().locked, "export:gone")
        await inbox.put({"type": "http.disconnect"})
        if not disconnect_cancels:
            # Django 4.2 does not listen while it streams: the lock stays until the generator
            # ends, which it does once its gate opens.
            still_held = await asyncio.to_thread(get_redlock().locked, "export:gone")
            assert still_held
            gate(g).open()
        await asyncio.wait_for(served, TIMEOUT)
        held_after = await asyncio.to_thread(get_redlock().locked, "export:gone")
        gate(g).open()  # let the abandoned generator's thread finish before the loop closes
        return held_while_streaming, held_after

    # Django 5.0 made ASGIHandler cancel a streaming response on http.disconnect.
    disconnect_cancels = django.VERSION >= (5, 0)
    try:
        held_while_streaming, held_after = asyncio.run(scenario())
    finally:
        gate(g).open()
    assert held_while_streaming
    assert not held_after
