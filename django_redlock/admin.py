"""The "Locks" admin page: live locks read from the Redis nodes, node health, force release.

The django-rq pattern: an unmanaged model (:class:`~django_redlock.models.Lock`) puts an entry
in the admin index and carries the permissions, and its ModelAdmin replaces every URL with views
that read Redis instead of the database. Every view is wrapped in ``admin_site.admin_view``
(login, staff, CSRF, never cached) and checks the model permissions itself:

* ``django_redlock.view_lock``: the list, lock details and the node health panel;
* ``django_redlock.release_lock``: the force-release confirmation and the release itself.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from . import admin_views as av
from .backends.registry import aliases as backend_aliases
from .backends.registry import get_locks
from .conf import get_config
from .core import LockInfo, Redlock, check_name
from .models import Lock

#: The session key of the admin's lock-service selector.
USING_SESSION_KEY = "django_redlock_using"

__all__ = ["LockAdmin"]


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    """Admin views over the locks on the Redis nodes (no database rows involved)."""

    #: Locks per page on the list.
    list_per_page = 100
    #: Seconds between reloads when the "auto-refresh" box is ticked.
    refresh_interval = 5

    # -- permissions ---------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the locks live on the nodes: nothing to add, change or delete here

    has_change_permission = has_delete_permission = has_add_permission

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user: Any = request.user
        return bool(user.has_perm(f"{self.opts.app_label}.view_{self.opts.model_name}"))

    def has_release_permission(self, request: HttpRequest) -> bool:
        user: Any = request.user
        return bool(user.has_perm(f"{self.opts.app_label}.release_lock"))

    # -- URLs ----------------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path("detail/", wrap(self.lock_detail_view), name="{}_{}_detail".format(*info)),
            path("nodes/", wrap(self.node_health_view), name="{}_{}_nodes".format(*info)),
            path("release/", wrap(self.release_view), name="{}_{}_release".format(*info)),
        ]

    def _url(self, view: str) -> str:
        opts = self.opts
        return reverse(
            f"admin:{opts.app_label}_{opts.model_name}_{view}", current_app=self.admin_site.name
        )

    def _render(
        self, request: HttpRequest, template: str, title: str, status: int = 200, **extra: Any
    ) -> TemplateResponse:
        """``admin/django_redlock/<template>`` with the admin's context, the page's links and
        ``extra``."""
        request.current_app = self.admin_site.name
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": True,
            "has_release_permission": self.has_release_permission(request),
            "list_url": self._url("changelist"),
            "detail_url": self._url("detail"),
            "nodes_url": self._url("nodes"),
            "release_url": self._url("release"),
            "refresh_interval": self.refresh_interval,
            "backend_aliases": backend_aliases(),
            "using": getattr(request, "session", {}).get(USING_SESSION_KEY) or "default",
            **extra,
        }
        return TemplateResponse(request, f"admin/django_redlock/{template}", context, status=status)

    @staticmethod
    def _redlock(request: HttpRequest) -> tuple[Redlock | None, str | None]:
        """The lock service chosen with ``?using=ALIAS`` (remembered in the session, so the
        detail, release and health pages stay on it); the Redlock over NODES by default."""
        using = request.GET.get("using")
        if using is not None and hasattr(request, "session"):
            request.session[USING_SESSION_KEY] = using
        elif hasattr(request, "session"):
            using = request.session.get(USING_SESSION_KEY)
        try:
            return get_locks(using or "default"), None
        except Exception as exc:  # a settings error: show it instead of a 500
            return None, f"The REDLOCK setting could not be used: {exc}"

    # -- the list ------------------------------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        query = request.GET.get("q", "")
        stuck_filter = request.GET.get("stuck", "")
        if stuck_filter not in ("", "any", *(code for code, _, _ in av.STUCK_REASONS)):
            stuck_filter = ""
        rl, error = self._redlock(request)
        stuck_after = get_config().get("STUCK_AFTER")
        rows: list[av.LockRow] = []
        if rl is not None:
            rows = av.build_rows(rl.live_locks(av.search_pattern(query)), stuck_after)
        total = len(rows)
        # Per-node copies, from the listing itself: the full health probe (rl.health()) also
        # SCANs every node and stays on its own page.
        per_node = Counter(s.node for r in rows for s in r.info.per_node)
        node_counts = [
            {
                "node": node.name,
                "master": getattr(node, "address", None),
                "locks": per_node.get(node.name, 0),
            }
            for node in (rl.nodes if rl is not None else [])
        ]
        counts = Counter(code for r in rows for code in r.reasons)
        counts["any"] = sum(1 for r in rows if r.stuck)
        if stuck_filter == "any":
            rows = [r for r in rows if r.stuck]
        elif stuck_filter:
            rows = [r for r in rows if stuck_filter in r.reasons]
        rows, order = av.sort_rows(rows, request.GET.get("o", av.DEFAULT_SORT))
        paginator = Paginator(rows, self.list_per_page)
        page = paginator.get_page(request.GET.get("p"))
        params = {"q": query, "stuck": stuck_filter, "o": order}

        def link(**changes: Any) -> str:
            merged = {**params, "p": page.number, **changes}
            if merged["o"] == av.DEFAULT_SORT:
                merged["o"] = ""
            if merged["p"] == 1:
                merged["p"] = ""
            return "?" + urlencode({k: v for k, v in merged.items() if v not in ("", None)})

        headers = []
        for name, label in (
            ("key", "Key"),
            ("holder", "Holder"),
            ("acquired", "Acquired"),
            ("age", "Age"),
            ("ttl", "Time left"),
            ("nodes", "Nodes"),
            ("renewals", "Renewals"),
            ("fence", "Fence"),
        ):
            sortable, current = name in av.SORT_FIELDS, order.lstrip("-") == name
            descending = order.startswith("-")
            # A click on the sorted column reverses it; on another, sorts it (largest first
            # where the large end is the interesting one).
            first = f"-{name}" if name in ("age", "renewals", "fence") else name
            new_order = (name if descending else f"-{name}") if current else first
            headers.append(
                {
                    "name": name,
                    "label": label,
                    "sortable": sortable,
                    "sorted": sortable and current,
                    "ascending": current and not descending,
                    "url": link(o=new_order, p=1) if sortable else "",
                }
            )
        counts[""] = total
        choices = [("", "All", ""), ("any", "Any stuck", "")]
        choices += [(code, label.capitalize(), why) for code, label, why in av.STUCK_REASONS]
        filters = [
            {
                "label": label,
                "url": link(stuck=code, p=1),
                "selected": stuck_filter == code,
                "count": counts[code],
                "help": why,
            }
            for code, label, why in choices
        ]
        page_links = [
            (i, link(p=i) if isinstance(i, int) else "")
            for i in paginator.get_elided_page_range(page.number, on_each_side=2, on_ends=1)
        ]
        return self._render(
            request,
            "lock_list.html",
            "Live locks",
            error=error,
            rows=page.object_list,
            page=page,
            paginator=paginator,
            page_links=page_links,
            pagination_required=paginator.num_pages > 1,
            headers=headers,
            filters=filters,
            query=query,
            stuck_filter=stuck_filter,
            order=order,
            total=total,
            shown=len(rows),
            stuck_after=stuck_after,
            node_counts=node_counts,
            # A node without a single copy of several locks is down or was emptied; with one
            # or two locks a missing copy is no evidence (an acquire may skip a slow node).
            silent_nodes=[n["node"] for n in node_counts if total >= 3 and not n["locks"]],
            quorum=rl.quorum if rl is not None else None,
            release_matching_query=urlencode({"pattern": av.search_pattern(query)}),
            **(extra_context or {}),
        )

    # -- one lock ------------------------------------------------------------------------------

    def lock_detail_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        name = request.GET.get("name", "")
        rl, error = self._redlock(request)
        info = None
        if rl is not None and _valid_name(name):
            info = rl.lock_info(name)
        row = None
        node_rows = []
        if rl is not None and info is not None:
            row = av.build_rows([info], get_config().get("STUCK_AFTER"))[0]
            by_node = {s.node: s for s in info.per_node}
            for node in rl.nodes:
                state = by_node.get(node.name)
                node_rows.append(
                    {
                        "node": node.name,
                        "master": getattr(node, "address", None),
                        "state": state,
                        "same_token": state is not None and state.token == info.token,
                    }
                )
        return self._render(
            request,
            "lock_detail.html",
            f"Lock {name}" if name else "Lock",
            200 if row else 404,
            error=error,
            name=name,
            row=row,
            node_rows=node_rows,
            quorum=rl.quorum if rl is not None else None,
        )

    # -- node health ---------------------------------------------------------------------------

    def node_health_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        rl, error = self._redlock(request)
        health = rl.health() if rl is not None else []
        kind = av.service_kind(rl)
        rows = [
            {
                "h": h,
                "latency_ms": None if h.latency is None else h.latency * 1000,
                "offset_ms": None if h.clock_offset is None else h.clock_offset * 1000,
                "guard_display": av.guard_display(h),
            }
            for h in health
        ]
        reachable = sum(1 for h in health if h.reachable)
        spread = av.clock_spread(health)
        quorum = rl.quorum if rl is not None else None
        summary = ""
        nouns = kind.noun if len(health) == 1 else kind.nouns
        if quorum and kind.redlock:
            summary = f"{reachable} of {len(health)} {nouns} reachable, quorum {quorum}: " + (
                "locks can be taken."
                if reachable >= quorum
                else "no lock can be taken until more nodes answer."
            )
        elif health:
            # The service keeps its own replication and quorum: the page can tell only
            # whether this server reaches it.
            summary = f"{reachable} of {len(health)} {nouns} reachable" + (
                "." if reachable else ": no lock can be taken until one answers."
            )
        return self._render(
            request,
            "node_health.html",
            kind.title,
            error=error,
            kind=kind,
            columns=dict(av.health_columns(kind, health)),
            rows=rows,
            summary=summary,
            summary_ok=rl is not None and reachable >= (quorum or 1),
            clock_spread_ms=None if spread is None else spread * 1000,
            drift_ms=None if rl is None else rl.ttl * rl.drift_factor * 1000,
        )

    # -- force release -------------------------------------------------------------------------

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """GET (or a POST from the list's checkboxes) shows a confirmation; a POST with
        ``confirm=yes`` releases. ``?pattern=report:*`` selects every live lock matching the
        glob, across all pages: the confirmation lists how many and which, and only those
        holders are released. Both need the release permission; POSTs need the CSRF token
        (``admin_view`` applies ``csrf_protect``)."""
        if not (self.has_view_permission(request) and self.has_release_permission(request)):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        names = list(dict.fromkeys(n for n in data.getlist("name") if _valid_name(n)))
        # A pattern's confirmation posts its (name, token) pairs as one JSON field: thousands
        # of hidden inputs would exceed DATA_UPLOAD_MAX_NUMBER_FIELDS.
        selection = _selection(data.get("selection", "")) if not names else {}
        names = names or list(selection)
        pattern = "" if names else data.get("pattern", "").strip()
        if not names and not pattern:
            messages.warning(request, "No locks were selected, so none were released.")
            return HttpResponseRedirect(self._url("changelist"))
        rl, error = self._redlock(request)
        if rl is None:
            messages.error(request, error or "No Redlock")
            return HttpResponseRedirect(self._url("changelist"))
        if pattern:
            matching = list(rl.live_locks(pattern))
            rows = av.build_rows(matching, get_config().get("STUCK_AFTER"))
            return self._render(
                request,
                "release_confirmation.html",
                "Force release matching locks?",
                rows=rows,
                missing=[],
                pattern=pattern,
                selection=json.dumps([[r.info.name, r.info.token] for r in rows]),
            )
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            tokens = request.POST.getlist("token")
            seen = dict(zip(names, tokens, strict=False)) if len(tokens) == len(names) else {}
            self._release(request, rl, names, selection or seen)
            return HttpResponseRedirect(self._url("changelist"))
        infos = [(name, rl.lock_info(name)) for name in names]
        present = [info for _, info in infos if info is not None]
        rows = av.build_rows(present, get_config().get("STUCK_AFTER"))
        return self._render(
            request,
            "release_confirmation.html",
            "Force release locks?",
            rows=rows,
            missing=[name for name, info in infos if info is None],
        )

    def _release(
        self, request: HttpRequest, rl: Redlock, names: Sequence[str], seen: dict[str, str]
    ) -> None:
        released: list[tuple[LockInfo, int]] = []
        gone: list[str] = []  # freed since the confirmation
        changed: list[str] = []  # taken by another holder since
        for name in names:
            info = rl.lock_info(name)
            if info is None:
                gone.append(name)
                continue
            token = seen.get(name) or info.token
            # Only the holder the operator confirmed: one that took the lock since is left
            # alone (the nodes compare the token, so there is no check-then-act gap).
            removed = rl.force_release(name, token=token)
            if not removed:
                changed.append(name)
                continue
            av.log_force_release(request.user, info, removed)
            released.append((info, removed))
        if released:
            listing = ", ".join(
                f"“{info.name}” ({removed}/{info.total_nodes} nodes)" for info, removed in released
            )
            count = len(released)
            messages.success(
                request, f"Force-released {count} lock{'' if count == 1 else 's'}: {listing}."
            )
        if gone:
            messages.info(request, f"Already free (released or expired): {_quoted(gone)}.")
        if changed:
            taken = "Not released because another holder took them after you confirmed"
            messages.warning(request, f"{taken}: {_quoted(changed)}.")


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(f"“{n}”" for n in names)


def _selection(raw: str) -> dict[str, str]:
    """``{name: token}`` from a pattern confirmation's JSON ``[[name, token], ...]``; anything
    malformed selects nothing."""
    try:
        pairs = json.loads(raw) if raw else []
    except ValueError:
        return {}
    if not isinstance(pairs, list):
        return {}
    return {
        name: token
        for pair in pairs
        if isinstance(pair, list) and len(pair) == 2
        for name, token in [pair]
        if isinstance(name, str) and isinstance(token, str) and _valid_name(name)
    }


def _valid_name(name: str) -> bool:
    try:
        check_name(name, listed=True)
    except (TypeError, ValueError):
        return False
    return True
