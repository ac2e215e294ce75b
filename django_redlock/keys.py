"""Lock keys from templates like ``"order:{order_id}"``, shared by ``@locked`` and
``LockedTask`` (neither integration imports the other), and the per-client key of views
whose users may be anonymous (:func:`client_id`, the ``{client}`` template field).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import string
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import date, datetime
from datetime import time as dtime
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from django.http import HttpRequest
from django.utils.functional import LazyObject, empty

from .core import MAX_KEY_LENGTH, printable

__all__ = [
    "CLIENT_FIELD",
    "KeyPart",
    "KeyTemplate",
    "base_request",
    "client_id",
    "compiled_template",
    "drf_request",
    "make_key",
    "printable",
    "shorten",
    "user_pk",
]

#: The template field ``@locked`` fills with :func:`client_id` of the view's request.
CLIENT_FIELD = "client"


#: Always escaped in values: the escape character itself, the separator convention, glob
#: characters (so ``redlock list --pattern`` matches what you mean), and format braces.
_ALWAYS = "%:*?[]\\{}"
#: Suffix marker of a hashed key; '%' followed by a lowercase letter never comes from a value.
_HASH_MARK = "%sha256-"
_TAGS = {None: "%none", True: "%true", False: "%false"}
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")


def _escaper(extra: str) -> Callable[[str], str]:
    chars = "".join(sorted(set(_ALWAYS) | set(extra)))
    needs = re.compile(f"[{re.escape(chars)}\\s\\x00-\\x1f\\x7f]")

    def escape_char(c: str) -> str:
        return "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))

    def escape(text: str) -> str:
        if not needs.search(text) and text.isprintable():
            return text
        return "".join(
            escape_char(c) if (needs.match(c) or not c.isprintable()) else c for c in text
        )

    return escape


class KeyPart(str):
    """Text that is a key part already, its own parts escaped (:func:`client_id`): a
    template inserts it as it is, so ``"cart:{client}"`` and ``f"cart:{client_id(request)}"``
    name the same lock."""

    __slots__ = ()


#: Escapes a value inside a :class:`KeyPart` (``:``, ``%``, glob characters, whitespace).
_escape_part = _escaper("")


class KeyTemplate:
    """A lock-key template like ``"order:{order_id}"`` compiled once.

    Values are rendered so that two different inputs never give the same key:

    * strings are kept readable, with ``%``, ``:``, glob characters, braces, whitespace and
      control characters, and every punctuation character that separates two fields in the
      template, percent-escaped (``"a:b"`` -> ``a%3Ab``);
    * ``None``, ``True`` and ``False`` become the tags ``%none``, ``%true``, ``%false`` (a
      string can never produce them, as its ``%`` is escaped);
    * integers, UUIDs, decimals, dates and enums render as their canonical text. An int and the
      string of its digits (``42`` and ``"42"``) deliberately give the *same* key: they name
      the same resource whichever way a URL converter or a JSON round trip typed it, and two
      keys for one resource would break mutual exclusion (see docs/usage.rst);
    * lists, tuples and sets render as ``[a,b]`` (sets sorted), mappings as ``{k=v,...}``
      (sorted), with ``,`` and ``=`` escaped in their items;
    * model instances and objects without a stable text (no ``__str__`` of their own, or one
      showing a memory address) are refused: use an attribute, ``{order.pk}``.

    The same rendering builds ``LockedTask``'s default key (one canonicalizer for both).

    Two fields must be separated by at least one punctuation character (checked here), so the
    key can be split back into its values. Keys longer than the core's limit keep a readable
    prefix and end in ``%sha256-<hex digest of the whole key>``.
    """

    def __init__(self, template: str) -> None:
        if not isinstance(template, str):
            raise TypeError(f"a lock key template must be a str, got {template!r}")
        if not template:
            raise ValueError("a lock key template must not be empty")
        self.template = template
        self.parts: list[tuple[str, str | None, str, str | None]] = []
        self.roots: set[str] = set()
        separators: list[str] = []
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ValueError(f"lock key template {template!r} is malformed: {exc}") from None
        seen_field = False
        for literal, field, spec, conversion in parsed:
            if seen_field and field is not None:
                punct = [c for c in literal if not c.isalnum() and c != "%"]
                if not punct:
                    raise ValueError(
                        f"lock key template {template!r}: fields must be separated by a "
                        f"punctuation character (e.g. ':'), got {literal!r} before {{{field}}}; "
                        "otherwise different values could give the same key"
                    )
                separators.extend(punct)
            if field is None:
                self.parts.append((literal, None, "", None))
                continue
            if not field or field[0].isdigit():
                raise ValueError(
                    f"lock key template {template!r}: {{{field}}} is positional; name an "
                    "argument instead, e.g. {order_id} or {request.user.pk}"
                )
            if spec and "{" in spec:
                raise ValueError(
                    f"lock key template {template!r}: nested fields in a format "
                    f"spec are not supported ({{{field}:{spec}}})"
                )
            root = re.split(r"[.\[]", field, maxsplit=1)[0]
            self.roots.add(root)
            self.parts.append((literal, field, spec or "", conversion))
            seen_field = True
        self._escape = _escaper("".join(separators))
        self._item = _escaper("".join(separators) + ",=")
        self._formatter = string.Formatter()
        #: Whether the template reads ``request.user`` or ``{client}`` (async views resolve
        #: the user first).
        self.needs_user = CLIENT_FIELD in self.roots or any(
            f is not None and re.match(r"request\.user\b", f) for _, f, _, _ in self.parts
        )

    def __repr__(self) -> str:
        return f"KeyTemplate({self.template!r})"

    @property
    def has_fields(self) -> bool:
        return bool(self.roots)

    def unknown_fields(self, signature: inspect.Signature, also: Iterable[str] = ()) -> list[str]:
        """The fields that name no argument of ``signature`` (nor one of ``also``), sorted;
        none when it takes ``**kwargs`` (any name may arrive there). Checked when a template
        meets its function, so a misspelt field fails at import, not at the first call."""
        params = signature.parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return []
        names = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
        return sorted(self.roots - names - set(also))

    def render(self, namespace: Mapping[str, Any]) -> str:
        out: list[str] = []
        for literal, field, spec, conversion in self.parts:
            out.append(literal)
            if field is None:
                continue
            try:
                value = self._formatter.get_field(field, (), namespace)[0]
            except KeyError as exc:
                names = ", ".join(sorted(namespace)) or "none"
                raise ValueError(
                    f"lock key template {self.template!r}: no argument {exc.args[0]!r} "
                    f"(available: {names})"
                ) from None
            except (AttributeError, IndexError, TypeError) as exc:
                raise ValueError(
                    f"lock key template {self.template!r}: cannot read {{{field}}}: {exc}"
                ) from None
            if conversion or spec:
                try:
                    if conversion:
                        value = self._formatter.convert_field(value, conversion)
                    text = format(value, spec) if spec else None
                except (TypeError, ValueError) as exc:
                    raise type(exc)(
                        f"lock key template {self.template!r}: cannot format {{{field}}} "
                        f"({type(value).__name__}): {exc}"
                    ) from None
                if text is not None:
                    out.append(self._escape(text))
                    continue
            out.append(self.encode(value, field))
        return shorten("".join(out))

    def encode(
        self, value: Any, field: str = "?", escape: Callable[[str], str] | None = None
    ) -> str:
        escape = escape or self._escape
        if isinstance(value, str):
            return value if value.__class__ is KeyPart else escape(value)
        if value is None or isinstance(value, bool):
            return _TAGS[value]
        if isinstance(value, Enum):
            return self.encode(value.value, field, escape)
        if isinstance(value, int):
            return escape(str(int(value)))
        if isinstance(value, (datetime, date, dtime)):
            return escape(value.isoformat())
        if isinstance(value, (float, Decimal, UUID)):
            return escape(str(value))
        # Containers (a task's list or dict argument) use brackets, which are escaped in every
        # string, and escape their own ',' and '=' in items, so nesting stays unambiguous;
        # a tuple and a set read as the list Celery's JSON round trip turns them into.
        if isinstance(value, Mapping):
            pairs = (
                f"{self.encode(k, field, self._item)}={self.encode(v, field, self._item)}"
                for k, v in value.items()
            )
            return "{" + ",".join(sorted(pairs)) + "}"
        if isinstance(value, (list, tuple, set, frozenset)):
            items = [self.encode(v, field, self._item) for v in value]
            if not isinstance(value, (list, tuple)):
                items.sort()
            return "[" + ",".join(items) + "]"
        if _is_model(value):
            raise TypeError(
                f"lock key template {self.template!r}: {{{field}}} is a "
                f"{type(value).__name__} instance; use one of its fields, e.g. {{{field}.pk}}"
            )
        own_str = type(value).__str__ is not object.__str__  # type: ignore[comparison-overlap]
        text = str(value) if own_str else ""
        if not own_str or _ADDRESS.search(text):
            raise TypeError(
                f"lock key template {self.template!r}: {{{field}}} is a "
                f"{type(value).__name__}, which has no stable text (no __str__ of its own, or "
                "one showing a memory address); use one of its attributes"
            )
        return escape(text)


def _is_model(value: Any) -> bool:
    from django.db.models import Model

    return isinstance(value, Model)


def shorten(key: str) -> str:
    """``key`` itself, or (over the core's length limit) a readable prefix plus a SHA-256."""
    if len(key) <= MAX_KEY_LENGTH:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key[: MAX_KEY_LENGTH - len(_HASH_MARK) - len(digest)] + _HASH_MARK + digest


@functools.lru_cache(maxsize=256)
def compiled_template(template: str) -> KeyTemplate:
    return KeyTemplate(template)


def make_key(template: str, /, **values: Any) -> str:
    """The key ``@locked(template)`` would use for these argument values."""
    return compiled_template(template).render(values)


def base_request(request: Any) -> HttpRequest:
    inner = getattr(request, "_request", None)
    return inner if isinstance(inner, HttpRequest) else request


def drf_request(request: Any) -> Any:
    """``request`` when it is a Django REST framework ``Request``, else None. DRF is never
    imported here: a DRF request exists only once DRF itself has been imported."""
    module = sys.modules.get("rest_framework.request")
    cls = getattr(module, "Request", None)
    return request if cls is not None and isinstance(request, cls) else None


def _loaded_user(request: Any, *, load: bool) -> Any:
    """The user object of ``request`` (None when not known and ``load`` is false).

    Under DRF the user is the one DRF's authentication classes found (a token, basic or
    session user), not Django's ``request.user`` of the session middleware, which is anonymous
    for a token client: reading the DRF request's ``user`` runs DRF's authentication if the
    view has not yet, as the view's own ``request.user`` would."""
    drf = drf_request(request)
    if drf is not None:
        if "_user" in drf.__dict__:
            return drf.__dict__["_user"]
        return drf.user if load else None
    user = base_request(request).__dict__.get("user")
    if isinstance(user, LazyObject):
        if user._wrapped is empty:
            if not load:
                return None
            user._setup()
        user = user._wrapped
    return user


def user_pk(request: Any, *, load: bool = False) -> Any:
    """The user's pk: only when the user is already loaded (never a query of our own),
    unless ``load`` (a lazy user is loaded, the query any view reading it makes). For a DRF
    request, the user DRF authenticated."""
    user = _loaded_user(request, load=load)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    return getattr(user, "pk", None)


def client_id(request: Any) -> KeyPart:
    """Who is asking, as a key part that never lumps anonymous users together:
    ``user:<pk>`` for an authenticated user (loaded if nothing has read ``request.user`` yet:
    every session of a user is one client; under DRF, the user its authentication classes
    found), else ``session:<key>`` when the client sent a session cookie, else
    ``ip:<REMOTE_ADDR>``, the pk, key or address escaped as a template escapes a value (an
    IPv6 address's colons become ``%3A``). A :class:`KeyPart`: ``{client}`` in a template
    inserts it as it is, so both forms name the same lock.

    ``{request.user.pk}`` renders ``%none`` for every anonymous user, so they all share one
    key; ``{client}`` in a view's template (or ``client_id(request)`` in a ``key=``
    callable) gives each visitor their own. Behind a proxy, REMOTE_ADDR is the proxy's
    address unless a middleware sets the client's.
    """
    user = user_pk(request, load=True)
    if user is not None:
        return KeyPart(f"user:{_escape_part(str(user))}")
    base = base_request(request)
    session = base.__dict__.get("session")
    key = getattr(session, "session_key", None) if session is not None else None
    if key:
        return KeyPart(f"session:{_escape_part(key)}")
    return KeyPart(f"ip:{_escape_part(base.META.get('REMOTE_ADDR') or 'unknown')}")
