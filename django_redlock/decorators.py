"""``@locked``: one decorator (and context manager) for every kind of Django callable.

It picks its wrapper from what it decorates: sync or async (``asgiref.sync.
iscoroutinefunction``, so Django's ``markcoroutinefunction`` views count as async), function
views, class-based handlers through ``method_decorator``, plain functions and methods, and
generator functions (the lock is held while the generator runs). It is a view when the first
argument (the second for a method taking ``self``) is an ``HttpRequest`` (or a DRF ``Request``).

Under Django REST framework it goes below ``@api_view`` (or on an ``APIView``/``ViewSet``
method), where the request is DRF's, authenticated: ``{client}`` and ``request.user`` are the
token/basic/session user DRF found, and a refusal is a DRF exception (423/503 with
``Retry-After``, see :mod:`django_redlock.drf`). Above ``@api_view``, or on an API view's
``dispatch``, it would run before DRF authenticates, so it is refused.

Keys come from a template formatted with the call's bound arguments (see :class:`KeyTemplate`
for the escaping that keeps distinct inputs on distinct keys), or from ``key=callable``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils.functional import LazyObject, empty
from django.utils.module_loading import import_string

from .backends.registry import get_async_locks, get_locks
from .conf import get_config
from .core import (
    LockInfo,
    LockNotAcquired,
    QuorumError,
    check_flag,
    check_limit,
    check_meta,
    check_positive,
    check_timeout,
)
from .holders import HoldTimes, expected_free_in
from .keys import (
    CLIENT_FIELD,
    KeyTemplate,
    base_request,
    client_id,
    compiled_template,
    drf_request,
    make_key,
    printable,
    shorten,
    user_pk,
)

__all__ = [
    "KeyTemplate",
    "Locked",
    "current_lock",
    "default_locked_response",
    "locked",
    "make_key",
    "retry_after_seconds",
]

logger = logging.getLogger("django_redlock")

_current: ContextVar[Any] = ContextVar("django_redlock_current_lock", default=None)
#: The reentrancy owner of the view running in this context (see :func:`_request_owner`), so
#: ``@locked`` functions a view calls re-enter the view's own locks.
_owner: ContextVar[Any] = ContextVar("django_redlock_owner", default=None)


def current_lock() -> Any:
    """The lock handle of the innermost ``@locked`` call running in this thread/task (None
    outside one): ``current_lock().fence`` gives a view its fencing token."""
    return _current.get()


# ============================================================================ responses


def retry_after_seconds(exc: LockNotAcquired) -> int:
    """Whole seconds for ``Retry-After``: ``exc.retry_after`` (``@locked``'s estimate of when
    the lock frees, see ``retry_after=``), rounded up, at least 1."""
    retry = getattr(exc, "retry_after", None)
    if retry is None or not math.isfinite(retry):
        return 1
    return max(1, math.ceil(retry))


def _wants_json(request: HttpRequest) -> bool:
    """JSON when the Accept header ranks a JSON type at least as high as HTML (``*/*`` alone
    does not count: a bare client gets the short text body)."""
    header = request.headers.get("Accept", "")
    best_json = best_html = 0.0
    for item in header.split(","):
        media, _, params = item.strip().partition(";")
        media = media.strip().lower()
        q = 1.0
        for param in params.split(";"):
            name, _, val = param.strip().partition("=")
            if name.strip() == "q":
                try:
                    q = float(val)
                except ValueError:
                    q = 0.0
        if media == "application/json" or media.endswith("+json"):
            best_json = max(best_json, q)
        elif media in ("text/html", "application/xhtml+xml", "text/*"):
            best_html = max(best_html, q)
    return best_json > 0 and best_json >= best_html


def default_locked_response(request: HttpRequest, exc: LockNotAcquired) -> HttpResponse:
    """423 Locked (503 when too few nodes answered) with ``Retry-After`` and a short body:
    JSON when the client asks for it, plain text otherwise. The lock name is not shown."""
    retry = retry_after_seconds(exc)
    unavailable = isinstance(exc, QuorumError)
    status = 503 if unavailable else 423
    detail = (
        "The lock service is unavailable; try again later."
        if unavailable
        else "This resource is being modified by another request; try again later."
    )
    response: HttpResponse
    if _wants_json(request):
        error = "unavailable" if unavailable else "locked"
        body = {"error": error, "detail": detail, "retry_after": retry}
        response = JsonResponse(body, status=status)
    else:
        text = f"{detail} (retry in {retry} s)\n"
        response = HttpResponse(text, status=status, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(retry)
    return response


@functools.lru_cache(maxsize=32)
def _import_handler(path: str) -> Callable[..., Any]:
    handler = import_string(path)
    if not callable(handler):
        raise TypeError(f"REDLOCK['LOCKED_RESPONSE'] {path!r} is not callable")
    return handler


# ============================================================================ the decorator


@dataclasses.dataclass
class _Call:
    """What one decorated call needs: key, request (views), owner and holder metadata."""

    name: str
    request: Any
    owner: Any
    meta: dict[str, Any]
    started: float | None = None  # monotonic time the lock was taken


class _Plan:
    """Per decorated function: signature, kind and the names a template may use."""

    def __init__(self, func: Callable[..., Any], template: KeyTemplate | None) -> None:
        self.qualname = (
            f"{getattr(func, '__module__', '?')}."
            f"{getattr(func, '__qualname__', type(func).__name__)}"
        )
        try:
            # method_decorator hands us functools.partial(bound method) that wraps() the
            # unbound function: its own signature (without self) is the one to bind against.
            self.signature: inspect.Signature | None = inspect.signature(
                func, follow_wrapped=not isinstance(func, functools.partial)
            )
        except (TypeError, ValueError):
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        self.method = bool(params) and params[0].name in ("self", "cls")
        self.var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        #: A method of a DRF API view instance, bound by ``method_decorator``.
        self.drf_view = _is_drf_view(getattr(getattr(func, "func", None), "__self__", None))
        if template is not None and self.signature is not None:
            missing = template.unknown_fields(self.signature, also=("request", CLIENT_FIELD))
            if missing:
                names = sorted(
                    p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                )
                raise ValueError(
                    f"locked({template.template!r}) on {self.qualname}: no argument named "
                    f"{', '.join(missing)} (arguments: {', '.join(names) or 'none'})"
                )


def _drf_api_view() -> Any:
    """DRF's ``APIView`` class when DRF has been imported (never imported here), else ``()``,
    which no class subclasses and no object is an instance of."""
    return getattr(sys.modules.get("rest_framework.views"), "APIView", ())


def _is_drf_view_function(func: Any) -> bool:
    """``func`` is what ``@api_view`` or ``APIView.as_view()`` returns (its ``cls``)."""
    cls = getattr(func, "cls", None)
    return isinstance(cls, type) and issubclass(cls, _drf_api_view())


def _is_drf_view(obj: Any) -> bool:
    """``obj`` is an instance of a DRF API view (an ``APIView``, a ``ViewSet``...)."""
    return isinstance(obj, _drf_api_view())


def _before_drf(plan: _Plan, args: tuple[Any, ...], request: Any) -> bool:
    """A view call on an API view that DRF has not wrapped yet (its ``dispatch``): the
    request is still Django's, not authenticated by DRF."""
    if drf_request(request) is not None:
        return False
    return plan.drf_view or (plan.method and bool(args) and _is_drf_view(args[0]))


def _drf_order_error(locked: Locked, where: str) -> str:
    return (
        f"{locked!r} on {where} runs before Django REST framework authenticates the "
        "request: request.user and {client} would be Django's session user (anonymous for "
        "token and basic auth, so every API client would share one lock), and an "
        "unauthenticated request could take the lock. Put @locked below @api_view (right "
        "above the def), or on the APIView/ViewSet method (get, post, an @action), not on "
        "as_view() or dispatch()"
    )


def _is_request(arg: Any) -> bool:
    return isinstance(arg, HttpRequest) or isinstance(getattr(arg, "_request", None), HttpRequest)


def _find_request(plan: _Plan, args: tuple[Any, ...]) -> Any:
    """The request when this is a view call: the first argument, or the second for a method
    (first parameter ``self``/``cls``) decorated without ``method_decorator``."""
    if args and _is_request(args[0]):
        return args[0]
    if plan.method and len(args) > 1 and _is_request(args[1]):
        return args[1]
    return None


def _request_owner(request: Any) -> object:
    """Reentrancy owner of a view: the request, not the thread. Under ASGI all sync views
    share one thread, so a thread owner would let a second request re-enter a lock the first
    still holds (e.g. while its streaming response runs)."""
    return base_request(request).__dict__.setdefault("_redlock_owner", object())


class Locked:
    """Hold a distributed lock around a view, function, method or ``with`` block:
    ``locked(...)`` is a decorator and a (sync or async) context manager.

    ``template`` is formatted with the call's arguments (``"order:{order_id}"``,
    ``"profile:{request.user.pk}"``); or pass ``key=callable`` taking the same arguments.
    ``ttl``: lease seconds (default ``REDLOCK['TTL']``). ``wait``: seconds to wait for the lock
    (0: one attempt; None: the Redlock's retry policy; ``math.inf``: for ever).
    ``auto_renew``: keep renewing while held (default ``REDLOCK['AUTO_RENEW']``).
    ``fencing``: draw a fencing token (``current_lock().fence``). ``on_locked``: for views,
    ``(request, exc) -> HttpResponse`` instead of the 423 response; for other callables
    ``(exc) -> value`` returned instead of raising :class:`LockNotAcquired`. ``meta``: extra
    holder details for the admin page. ``retry_after``: seconds for the ``Retry-After`` of
    a refused view (or a callable ``(exc) -> seconds``, ``exc.retry_after`` being the holder's
    remaining lease); default: the typical hold of this decorator's calls, capped by that
    lease. ``using``: the lock service, a ``REDLOCK["BACKENDS"]``
    alias (default: the Redlock over ``NODES``). ``limit=N``: a semaphore instead of a
    lock, at most N calls inside at once per key (423 when all permits are taken);
    ``shared=True``: a read lock (many at once); ``writer=True``: the write side of the same
    read/write lock, which waits for the readers and holds new ones back (a plain ``@locked``
    on the same key is a plain lock, which does not see readers).
    """

    def __init__(
        self,
        template: str | None = None,
        /,
        *,
        ttl: float | None = None,
        wait: float | None = 0,
        auto_renew: bool | None = None,
        fencing: bool = False,
        key: Callable[..., str] | None = None,
        on_locked: Callable[..., Any] | str | None = None,
        meta: Mapping[str, Any] | None = None,
        fair: bool = False,
        reentrant: bool | None = None,
        renew_for: float | None = None,
        retry_after: float | Callable[[LockNotAcquired], float] | None = None,
        using: str = "default",
        limit: int | None = None,
        shared: bool = False,
        writer: bool = False,
    ) -> None:
        if callable(template):
            raise TypeError("@locked needs a key: write @locked('name:{arg}'), not @locked")
        if template is None and key is None:
            raise TypeError("locked() needs a key template or key=callable")
        if template is not None and key is not None:
            raise TypeError("give locked() a key template or key=callable, not both")
        if key is not None and not callable(key):
            raise TypeError(f"key must be a callable returning the lock name, got {key!r}")
        self.template = compiled_template(template) if template is not None else None
        self.key = key
        self.ttl = None if ttl is None else check_positive("ttl", ttl)
        try:
            self.wait = check_timeout(wait)
        except (TypeError, ValueError) as exc:  # the core's rule, named as @locked's argument
            raise type(exc)(f"wait (seconds >= 0, None or math.inf): {exc}") from None
        if retry_after is not None and not callable(retry_after):
            retry_after = check_positive("retry_after", retry_after, allow_zero=True)
        self.retry_after = retry_after
        #: How long this decorator's calls held their lock lately (the default Retry-After).
        self._holds = HoldTimes()
        self.auto_renew = None if auto_renew is None else check_flag("auto_renew", auto_renew)
        self.fencing = check_flag("fencing", fencing)
        if on_locked is not None and not (callable(on_locked) or isinstance(on_locked, str)):
            raise TypeError(f"on_locked must be a callable or a dotted path, got {on_locked!r}")
        self.on_locked = on_locked
        self.meta = check_meta(meta)
        self.fair = check_flag("fair", fair)
        self.reentrant = reentrant
        if renew_for is not None and auto_renew is False:
            raise ValueError(f"renew_for={renew_for!r} caps auto-renewal: it needs auto_renew")
        self.renew_for = renew_for
        self.limit, self.shared, self.writer = _check_kind(
            limit, shared, writer, fair=fair, reentrant=reentrant, fencing=self.fencing
        )
        self.values: dict[str, Any] = {}
        #: The REDLOCK["BACKENDS"] alias the lock is taken on (get_locks(alias)).
        self.backend = using
        self._plans: dict[Any, _Plan] = {}
        self._held: ContextVar[tuple[Any, ...]] = ContextVar(f"locked_{id(self)}", default=())

    def __repr__(self) -> str:
        what = self.template.template if self.template is not None else self.key
        return f"<locked {what!r}>"

    def using(self, **values: Any) -> Locked:
        """A copy whose template fields come from ``values``: ``with locked("order:{id}")
        .using(id=42):`` (values are escaped like arguments)."""
        clone = Locked.__new__(Locked)
        clone.__dict__.update(self.__dict__)
        clone.values = {**self.values, **values}
        clone._plans = {}
        clone._holds = HoldTimes()
        clone._held = ContextVar(f"locked_{id(clone)}", default=())
        return clone

    # -- building a call ---------------------------------------------------------------------

    def _plan(self, func: Callable[..., Any]) -> _Plan:
        ident = func
        if isinstance(func, functools.partial):  # method_decorator: a new partial per call
            ident = getattr(func.func, "__func__", func.func)
        plan = self._plans.get(ident)
        if plan is None:
            plan = self._plans[ident] = _Plan(func, self.template)
        return plan

    def _call(self, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        if isinstance(self.on_locked, str):
            # A dotted on_locked is imported at the first call (at decoration the module it
            # names may still be loading): a wrong path fails every call, not only a refused
            # one, and before anything is sent.
            self.on_locked = self._handler()
        request = _find_request(plan, args)
        if request is not None and _before_drf(plan, args, request):
            raise TypeError(_drf_order_error(self, plan.qualname))
        name = self._name(plan, args, kwargs, request)
        if request is None:
            return _Call(name, None, _owner.get(), {"function": plan.qualname, **self.meta})
        base = base_request(request)
        meta = {"view": plan.qualname, "path": base.path, "method": base.method}
        user = user_pk(request)
        if user is not None:
            meta["user"] = user
        return _Call(name, request, _request_owner(request), {**meta, **self.meta})

    def _name(
        self, plan: _Plan | None, args: tuple[Any, ...], kwargs: dict[str, Any], request: Any
    ) -> str:
        """The lock name: what ``key=`` returns (shortened), or the template rendered with the
        arguments of a decorated call (``plan``), or a ``with`` block's ``.using()`` values."""
        if self.key is not None:
            name = self.key(*args, **kwargs)
            if not isinstance(name, str):
                where = plan.qualname if plan is not None else "a with block"
                raise TypeError(f"key= callable of {where} returned {name!r}, not a str")
            return shorten(name)
        assert self.template is not None
        if not self.template.has_fields:
            return self.template.template
        if plan is None:
            return self.template.render(self.values)
        return self.template.render(self._namespace(plan, args, kwargs, request))

    def _namespace(
        self, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], request: Any
    ) -> dict[str, Any]:
        namespace = dict(self.values)
        assert self.template is not None
        if all(
            r in kwargs or (r == "request" and request is not None) for r in self.template.roots
        ):
            # Fast path (views: URL arguments arrive as keywords): no signature binding.
            namespace.update(kwargs)
        elif plan.signature is not None:
            bound = plan.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            extra = arguments.pop(plan.var_keyword, None) if plan.var_keyword else None
            namespace.update(arguments)
            if extra:
                for k, v in extra.items():
                    namespace.setdefault(k, v)
        else:
            namespace.update(kwargs)
        if request is not None:
            namespace.setdefault("request", request)
            if CLIENT_FIELD in self.template.roots:
                namespace.setdefault(CLIENT_FIELD, client_id(request))
        return namespace

    def _lock(self, redlock: Any, call: _Call) -> Any:
        auto_renew = self.auto_renew
        if auto_renew is None:
            # renew_for caps a renewal: it asks for one whatever the setting says.
            auto_renew = self.renew_for is not None or bool(get_config().get("AUTO_RENEW", False))
        meta = {**call.meta, **self._holds.meta(_HOLD)}
        common = {"auto_renew": auto_renew, "meta": meta, "owner": call.owner}
        common["renew_for"] = self.renew_for
        name, ttl, fencing, fair = call.name, self.ttl, self.fencing, self.fair
        if self.limit is not None:
            return redlock.semaphore(name, self.limit, ttl, fencing=fencing, fair=fair, **common)
        if self.shared:
            return redlock.read_lock(name, ttl, **common)
        if self.writer:
            return redlock.write_lock(name, ttl, fencing=fencing, **common)
        return redlock.lock(
            name, ttl, fencing=fencing, reentrant=self.reentrant, fair=fair, **common
        )

    @staticmethod
    def _acquire_args_for(lock: Any, wait: float | None) -> dict[str, Any]:
        if wait is None and getattr(lock, "kind", None) is not None:
            # A permit or a read hold waits by time: as long as the retry policy's retries.
            redlock = lock.redlock
            tries = redlock.retry_count + 1
            return {"blocking": True, "timeout": tries * max(redlock.retry_delay, 0.01)}
        if wait is None:
            # The lock service's retry policy (REDLOCK["RETRY_COUNT"] retries).
            return {"blocking": True, "retries": lock.redlock.retry_count}
        if wait == 0:
            return {"blocking": False}
        return {"blocking": True, "timeout": wait}

    @staticmethod
    def _enter(lock: Any, call: _Call) -> tuple[Any, Any]:
        call.started = time.monotonic()
        return _current.set(lock), _owner.set(call.owner)

    @staticmethod
    def _exit(tokens: tuple[Any, Any]) -> None:
        _current.reset(tokens[0])
        _owner.reset(tokens[1])

    def _busy(self, lock: Any, holder: LockInfo | None = None) -> LockNotAcquired:
        what = f"lock {lock.name!r} is held by another owner"
        if getattr(lock, "kind", None) is not None:
            what = str(lock._not_acquired())
        exc = LockNotAcquired(what, lock.name, retry_after=lock.retry_after)
        exc.retry_after = self._expected_wait(exc, holder)
        return exc

    def _asks_holder(self) -> bool:
        """Whether a refused view should read the holder's metadata for its Retry-After (only
        while this decorator knows no typical hold of its own)."""
        return self.retry_after is None and self._holds.typical(_HOLD) is None

    def _expected_wait(self, exc: LockNotAcquired, holder: LockInfo | None = None) -> float | None:
        """When to try again: ``retry_after=`` (seconds, or a callable given the refusal
        with the holder's remaining lease in ``exc.retry_after``); by default the typical
        hold of this decorator's calls, else the one the holder published (minus what it has
        held so far), never more than the holder's remaining lease (a 200 ms critical section
        answers "1 s", not the 30 s lease)."""
        lease = exc.retry_after
        if callable(self.retry_after):
            return check_positive("retry_after", self.retry_after(exc), allow_zero=True)
        if self.retry_after is not None:
            return self.retry_after
        typical = self._holds.typical(_HOLD)
        if typical is None and holder is not None:
            typical = expected_free_in(holder.meta, holder.age, holder.ttl)
        if typical is None:
            return lease
        return typical if lease is None else min(typical, lease)

    # -- not acquired --------------------------------------------------------------------------

    def _handler(self) -> Callable[..., Any] | None:
        handler = self.on_locked
        if isinstance(handler, str):
            try:
                return _import_handler(handler)
            except ImportError as exc:
                msg = f"@locked on_locked={handler!r} cannot be imported: {exc}"
                raise ImportError(msg) from exc
        return handler

    def _view_handler(self, request: Any) -> Callable[..., Any]:
        handler = self._handler()
        if handler is not None:
            return handler
        path = get_config().get("LOCKED_RESPONSE")
        if path:
            return path if callable(path) else _import_handler(path)
        if drf_request(request) is not None:
            return _drf_refusal
        return default_locked_response

    def _refused(self, call: _Call, exc: LockNotAcquired) -> Any:
        """The outcome of a call that did not get its lock (may be awaitable)."""
        if call.request is None:
            handler = self._handler()
            if handler is None:
                raise exc
            return handler(exc)
        # A 503 is not contention: nodes failed, and every request on this name fails until
        # they are back, so operators must see it (a warning) and which nodes and why.
        unavailable = isinstance(exc, QuorumError)
        logger.log(
            logging.WARNING if unavailable else logging.INFO,
            "lock %s %s: %s %s answered %s (retry after %s s)",
            # The path (and a key made of it) is the client's: escaped, it forges no line.
            printable(call.name),
            printable(f"unavailable ({exc})" if unavailable else "busy"),
            printable(call.meta.get("method")),
            printable(call.meta.get("path")),
            503 if unavailable else "as locked",
            retry_after_seconds(exc),
            extra={
                "lock_name": call.name,
                "lock_event": "unavailable" if unavailable else "refused",
                "lock_retry_after": exc.retry_after,
            },
        )
        return self._view_handler(call.request)(call.request, exc)

    @staticmethod
    def _finish_response(response: Any, exc: LockNotAcquired) -> Any:
        if (
            isinstance(response, HttpResponseBase)
            and response.status_code in (423, 429, 503)
            and not response.has_header("Retry-After")
        ):
            response["Retry-After"] = str(retry_after_seconds(exc))
        return response

    # -- release -------------------------------------------------------------------------------

    @staticmethod
    def _release_failed(call: _Call, exc: BaseException, *, failed: bool) -> None:
        """Release raised: log it; raise it for a plain call that otherwise succeeded (its
        caller must learn that the lock may not have been exclusive the whole time)."""
        if failed or call.request is not None:
            logger.error(
                "lock %s: release failed: %s",
                printable(call.name),
                printable(exc),
                extra={"lock_name": call.name, "lock_event": "release_failed"},
            )
            return
        raise exc

    def _record_hold(self, call: _Call) -> None:
        if call.started is not None:
            self._holds.record(_HOLD, time.monotonic() - call.started)

    def _release(self, lock: Any, call: _Call, *, failed: bool) -> None:
        self._record_hold(call)
        try:
            lock.release()
        except Exception as exc:  # LockNotOwned / LockLost, or a node error
            self._release_failed(call, exc, failed=failed)

    async def _arelease(self, lock: Any, call: _Call, *, failed: bool) -> None:
        self._record_hold(call)
        try:
            await lock.release()
        except Exception as exc:
            self._release_failed(call, exc, failed=failed)

    # -- decorating ----------------------------------------------------------------------------

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(func):
            raise TypeError(f"@locked decorates a callable, got {func!r}")
        if _is_drf_view_function(func):
            raise TypeError(_drf_order_error(self, f"the API view {func.__name__}"))
        plan = self._plan(func)
        if inspect.isasyncgenfunction(func):
            wrapper = self._wrap_async_gen(func, plan)
        elif inspect.isgeneratorfunction(func):
            wrapper = self._wrap_gen(func, plan)
        elif iscoroutinefunction(func):
            wrapper = self._wrap_async(func, plan)
        else:
            wrapper = self._wrap_sync(func, plan)
        wrapper.locked = self  # type: ignore[attr-defined]
        return wrapper

    def _wrap_sync(self, func: Callable[..., Any], plan: _Plan) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = self._call(plan, args, kwargs)
            redlock = get_locks(self.backend)
            lock = self._lock(redlock, call)
            try:
                acquired = lock.acquire(**self._acquire_args_for(lock, self.wait))
            except LockNotAcquired as exc:  # QuorumError: too few nodes answered
                return self._finish_response(self._refused(call, exc), exc)
            if not acquired:
                asks = call.request is not None and self._asks_holder()
                busy = self._busy(lock, _quietly(redlock.lock_info, call.name) if asks else None)
                return self._finish_response(self._refused(call, busy), busy)
            tokens = self._enter(lock, call)
            try:
                result = func(*args, **kwargs)
            except BaseException:
                self._exit(tokens)
                self._release(lock, call, failed=True)
                raise
            self._exit(tokens)
            if call.request is not None and isinstance(result, StreamingHttpResponse):
                return _StreamRelease(self, lock, call, is_async=False).attach(result)
            self._release(lock, call, failed=False)
            return result

        return wrapper

    def _wrap_async(self, func: Callable[..., Any], plan: _Plan) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.template is not None and self.template.needs_user:
                await _resolve_user(_find_request(plan, args))
            call = self._call(plan, args, kwargs)
            redlock = get_async_locks(self.backend)
            lock = self._lock(redlock, call)
            refusal: LockNotAcquired | None = None
            try:
                acquired = await lock.acquire(**self._acquire_args_for(lock, self.wait))
            except LockNotAcquired as exc:
                refusal, acquired = exc, False
            if not acquired:
                if refusal is None:
                    asks = call.request is not None and self._asks_holder()
                    holder = await _aquietly(redlock.lock_info, call.name) if asks else None
                    refusal = self._busy(lock, holder)
                outcome = self._refused(call, refusal)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
                return self._finish_response(outcome, refusal)
            tokens = self._enter(lock, call)
            try:
                result = await func(*args, **kwargs)
            except BaseException:
                self._exit(tokens)
                await self._arelease(lock, call, failed=True)
                raise
            self._exit(tokens)
            if call.request is not None and isinstance(result, StreamingHttpResponse):
                return _StreamRelease(self, lock, call, is_async=True).attach(result)
            await self._arelease(lock, call, failed=False)
            return result

        return wrapper

    def _wrap_gen(self, func: Callable[..., Any], plan: _Plan) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = self._call(plan, args, kwargs)
            lock = self._lock(get_locks(self.backend), call)
            if not lock.acquire(**self._acquire_args_for(lock, self.wait)):
                raise self._busy(lock)
            try:
                yield from func(*args, **kwargs)
            except BaseException:
                self._release(lock, call, failed=True)
                raise
            self._release(lock, call, failed=False)

        return wrapper

    def _wrap_async_gen(self, func: Callable[..., Any], plan: _Plan) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = self._call(plan, args, kwargs)
            lock = self._lock(get_async_locks(self.backend), call)
            if not await lock.acquire(**self._acquire_args_for(lock, self.wait)):
                raise self._busy(lock)
            try:
                async for item in func(*args, **kwargs):
                    yield item
            except BaseException:
                await self._arelease(lock, call, failed=True)
                raise
            await self._arelease(lock, call, failed=False)

        return wrapper

    # -- context manager -----------------------------------------------------------------------

    def _standalone_call(self) -> _Call:
        name = self._name(None, (), {}, None)
        frame = sys._getframe(2)
        meta = {
            "code": f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})",
            **self.meta,
        }
        return _Call(name, None, _owner.get(), meta)

    def __enter__(self) -> Any:
        call = self._standalone_call()
        lock = self._lock(get_locks(self.backend), call)
        if not lock.acquire(**self._acquire_args_for(lock, self.wait)):
            raise self._busy(lock)
        self._held.set((*self._held.get(), (lock, call)))
        return lock

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._release(*self._innermost(), failed=exc_type is not None)

    async def __aenter__(self) -> Any:
        call = self._standalone_call()
        lock = self._lock(get_async_locks(self.backend), call)
        if not await lock.acquire(**self._acquire_args_for(lock, self.wait)):
            raise self._busy(lock)
        self._held.set((*self._held.get(), (lock, call)))
        return lock

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        await self._arelease(*self._innermost(), failed=exc_type is not None)

    def _innermost(self) -> tuple[Any, _Call]:
        """The lock and call of the innermost ``with`` block of this context, popped."""
        held = self._held.get()
        self._held.set(held[:-1])
        return held[-1]


def _drf_refusal(request: Any, exc: LockNotAcquired) -> None:
    """A refused DRF view raises DRF's exception (423/503, ``Retry-After``), for the
    project's DRF exception handler and the negotiated renderer to answer with."""
    from .drf import raise_refusal

    raise_refusal(request, exc, retry_after_seconds(exc))


async def _resolve_user(request: Any) -> None:
    """Load ``request.user`` the async way before the template reads it (reading the lazy
    user from async code would be a synchronous query)."""
    if request is None:
        return
    base = base_request(request)
    user = base.__dict__.get("user")
    if isinstance(user, LazyObject) and user._wrapped is empty:
        auser = getattr(base, "auser", None)
        if auser is not None:
            base.user = await auser()
        else:  # Django < 5.0: no async user loader
            await sync_to_async(user._setup)()


class _StreamRelease:
    """Releases a view's lock when its streaming response ends: content exhausted, or the
    response closed by the server (client gone), whichever comes first, exactly once."""

    def __init__(self, owner: Locked, lock: Any, call: _Call, *, is_async: bool) -> None:
        self.owner = owner
        self.lock = lock
        self.call = call
        self.is_async = is_async  # the lock's kind (an AsyncRedlock lock needs awaiting)
        #: Taken by the first release and never given back: the later ones see it taken.
        self._once = threading.Lock()

    def release(self) -> None:
        if not self._once.acquire(blocking=False):
            return
        if not self.is_async:
            self.owner._release(self.lock, self.call, failed=False)
            return
        coro = self.owner._arelease(self.lock, self.call, failed=False)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                async_to_sync(_await)(coro)
            except Exception as exc:
                logger.error(
                    "lock %s: release after streaming failed: %s",
                    printable(self.call.name),
                    printable(exc),
                )
        else:
            task = loop.create_task(coro)
            _pending.add(task)
            task.add_done_callback(_pending.discard)

    async def arelease(self) -> None:
        if not self._once.acquire(blocking=False):
            return
        if self.is_async:
            await self.owner._arelease(self.lock, self.call, failed=False)
        else:
            self.owner._release(self.lock, self.call, failed=False)

    def attach(self, response: StreamingHttpResponse) -> StreamingHttpResponse:
        content = response.streaming_content
        if response.is_async:

            async def agen() -> Any:
                try:
                    async for chunk in content:  # type: ignore[union-attr]
                        yield chunk
                finally:
                    await self.arelease()

            response.streaming_content = agen()
        else:

            def gen() -> Any:
                try:
                    yield from content  # type: ignore[misc]
                finally:
                    self.release()

            response.streaming_content = gen()
        response._resource_closers.append(self.release)  # type: ignore[attr-defined]
        return response


_pending: set[asyncio.Task[Any]] = set()


def _quietly(read: Callable[[str], Any], name: str) -> Any:
    """``read(name)``, or None when the nodes cannot tell (the 423 goes out anyway)."""
    try:
        return read(name)
    except Exception:
        logger.debug("could not read the holder of %s", printable(name), exc_info=True)
        return None


async def _aquietly(read: Callable[[str], Any], name: str) -> Any:
    try:
        return await read(name)
    except Exception:
        logger.debug("could not read the holder of %s", printable(name), exc_info=True)
        return None


#: The one kind of hold a ``Locked`` records (its HoldTimes is per decorator).
_HOLD = "call"


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _check_kind(
    limit: object,
    shared: object,
    writer: object,
    *,
    fair: bool,
    reentrant: bool | None,
    fencing: bool,
) -> tuple[int | None, bool, bool]:
    """``@locked``'s ``limit`` / ``shared`` / ``writer``: a semaphore, a read lock, the write
    lock, or (none of them) a lock. Options a kind cannot honour are refused, not ignored."""
    shared, writer = check_flag("shared", shared), check_flag("writer", writer)
    if sum((limit is not None, shared, writer)) > 1:
        raise ValueError(
            "give @locked one of limit= (a semaphore), shared=True (a read lock) and "
            "writer=True (the write lock)"
        )
    if limit is not None:
        limit = check_limit(limit)
    if (limit is not None or shared or writer) and reentrant:
        raise ValueError("a semaphore's permits, read holds and write holds are not reentrant")
    if (shared or writer) and fair:
        raise ValueError("a read/write lock has no fair line (its writers hold readers back)")
    if shared and fencing:
        raise ValueError("shared=True takes a read lock, which draws no fence")
    return limit, shared, writer


locked = Locked
