"""What a lock name is called in metrics and traces: a bounded label, never the full name.

Full lock names (``order:42``, ``order:43``...) would give a time series per order: the label is
the part before the first ``:`` by default (``order``), or what ``REDLOCK["METRICS"]["LABEL"]``
(a callable or a dotted path to one) makes of the name. Past :data:`DEFAULT_MAX_LABELS`
distinct values, further ones are counted as ``"other"`` (and a warning is logged once), so a
label function that lets ids through cannot grow the series without bound.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from django.utils.module_loading import import_string

from .core import printable

__all__ = ["DEFAULT_MAX_LABELS", "OTHER", "LockLabels", "default_label", "label_function"]

logger = logging.getLogger("django_redlock")

#: Distinct label values kept before the rest count as :data:`OTHER`.
DEFAULT_MAX_LABELS = 100
#: The label of names past the limit, or whose label function raised.
OTHER = "other"


def default_label(name: str) -> str:
    """The part of the lock name before the first ``:`` (the whole name without one)."""
    return name.split(":", 1)[0]


def label_function(value: Any) -> Callable[[str], Any]:
    """``REDLOCK["METRICS"]["LABEL"]`` as a callable: None gives :func:`default_label`; a
    dotted path is imported. ValueError/TypeError naming the problem otherwise."""
    if value is None:
        return default_label
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ValueError(
                f"REDLOCK['METRICS']['LABEL'] {value!r} does not import: {exc}"
            ) from None
    if not callable(value):
        raise TypeError(
            f"REDLOCK['METRICS']['LABEL'] must be a callable (lock name -> label) or a dotted "
            f"path to one, got {value!r}"
        )
    return value


class LockLabels:
    """Lock name -> label, with at most ``limit`` distinct labels."""

    def __init__(self, function: Callable[[str], Any] = default_label, limit: int = 100) -> None:
        self.function = function
        self.limit = limit
        self._seen: set[str] = set()
        self._mutex = threading.Lock()
        self._warned = False

    @classmethod
    def from_settings(cls, metrics: Any) -> LockLabels:
        """From ``REDLOCK["METRICS"]`` (True, or a dict with ``LABEL``/``MAX_LABELS``)."""
        options = metrics if isinstance(metrics, Mapping) else {}
        return cls(
            label_function(options.get("LABEL")),
            int(options.get("MAX_LABELS", DEFAULT_MAX_LABELS)),
        )

    def __call__(self, name: str) -> str:
        try:
            label = str(self.function(name))
        except Exception:
            logger.warning("the lock label function failed on %s", printable(name), exc_info=True)
            return OTHER
        if label in self._seen:
            return label
        with self._mutex:
            if label in self._seen:
                return label
            if len(self._seen) < self.limit:
                self._seen.add(label)
                return label
            if not self._warned:
                self._warned = True
                logger.warning(
                    "more than %s distinct lock labels; lock %s and later new ones are "
                    "counted as %r (REDLOCK['METRICS']['LABEL'] or 'MAX_LABELS')",
                    self.limit,
                    printable(name),
                    OTHER,
                )
        return OTHER
