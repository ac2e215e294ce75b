"""A view's ``@locked`` hold is re-entered by a same-key ``@locked`` function of the other
colour that it calls through asgiref (``sync_to_async`` / ``async_to_sync``): the view holds
the lock through ``get_async_redlock()`` (or ``get_redlock()``) and the function asks the
other client, yet both count one owner's holds of one lease (docs/usage.rst, "Reentrancy and
owners"). Served by Django's test ``Client`` (WSGI) and ``AsyncClient`` (ASGI), against the
shared real nodes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpRequest, JsonResponse
from django.test import AsyncClient, Client
from django.urls import path

from django_redlock import LockNotAcquired, get_async_redlock, get_redlock, locked
from django_redlock.decorators import current_lock

pytestmark = [pytest.mark.usefixtures("redlock_settings"), pytest.mark.urls(__name__)]

#: Long enough that an inner call waiting for its own view would show (it fails after it).
WAIT = 5.0


def someone_else_gets(name: str) -> bool:
    """Whether another owner could take ``name`` now (given back at once if it could)."""
    lock = get_redlock().lock(name, owner="someone-else")
    got = lock.acquire(blocking=False)
    if got:
        lock.release()
    return got


async def someone_else_gets_async(name: str) -> bool:
    lock = get_async_redlock().lock(name, owner="someone-else")
    got = await lock.acquire(blocking=False)
    if got:
        await lock.release()
    return got


@locked("across:{n}", wait=WAIT)
def sync_service(n: int) -> dict[str, Any]:
    lock = current_lock()
    return {"token": lock.token, "others": someone_else_gets(lock.name)}


@locked("across:{n}", wait=WAIT)
async def async_service(n: int) -> dict[str, Any]:
    lock = current_lock()
    return {"token": lock.token, "others": await someone_else_gets_async(lock.name)}


@locked("across:{n}")
async def async_view(request: HttpRequest, n: int) -> JsonResponse:
    outer = current_lock()
    began = time.monotonic()
    inner = await sync_to_async(sync_service)(n)
    took = time.monotonic() - began
    # The inner release dropped its hold only: the view still holds the lock.
    after = await someone_else_gets_async(outer.name)
    return JsonResponse({"outer": outer.token, **inner, "took": took, "after": after})


@locked("across:{n}")
def sync_view(request: HttpRequest, n: int) -> JsonResponse:
    outer = current_lock()
    began = time.monotonic()
    inner = async_to_sync(async_service)(n)
    took = time.monotonic() - began
    after = someone_else_gets(outer.name)
    return JsonResponse({"outer": outer.token, **inner, "took": took, "after": after})


urlpatterns = [
    path("async/<int:n>/", async_view),
    path("sync/<int:n>/", sync_view),
]


def served(view: str, server: str, n: int) -> dict[str, Any]:
    url = f"/{view}/{n}/"
    if server == "wsgi":
        response = Client().get(url)
    else:

        async def get() -> Any:
            return await AsyncClient().get(url)

        response = asyncio.run(get())
    assert response.status_code == 200, response.content
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("server", ["wsgi", "asgi"])
@pytest.mark.parametrize("view", ["async", "sync"])
def test_a_function_of_the_other_colour_re_enters_the_views_lock(view: str, server: str) -> None:
    n = {"async": 1, "sync": 2}[view] * 10 + {"wsgi": 1, "asgi": 2}[server]
    seen = served(view, server, n)
    assert seen["token"] == seen["outer"]  # the inner body ran in the view's own hold
    assert seen["took"] < WAIT  # it did not wait for its own view
    assert seen["others"] is False and seen["after"] is False
    assert not get_redlock().locked(f"across:{n}")  # released once, by the view's end


def test_another_owner_is_still_refused() -> None:
    """Holds are shared per owner: sync code run for an async caller that is not a view (its
    owner is its task, the thread's is the thread) does not join the caller's hold."""

    @locked("across:0", wait=0)
    def elsewhere() -> str:
        return "ran"

    @locked("across:0")
    async def holder() -> None:
        with pytest.raises(LockNotAcquired):
            await asyncio.to_thread(elsewhere)

    asyncio.run(holder())
    assert not get_redlock().locked("across:0")
