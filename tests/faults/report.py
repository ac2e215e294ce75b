"""The results table (RST grid for docs/faults.rst, or Markdown)."""

from __future__ import annotations

from collections.abc import Sequence

from .harness import ScenarioResult

__all__ = ["HEADERS", "rows", "table"]

HEADERS = (
    "Scenario",
    "Nodes / clients",
    "Cycles",
    "Faults injected",
    "Overlaps",
    "Stale writes rejected",
    "Recovery",
)


def rows(results: Sequence[ScenarioResult]) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        rec = "-" if r.recovery is None else f"{r.recovery:.2f} s"
        out.append(
            (
                r.title,
                f"{r.nodes} / {r.clients}",
                str(r.cycles),
                str(r.faults),
                str(len(r.overlaps)),
                str(r.stale_rejected),
                rec,
            )
        )
    return out


def table(
    results: Sequence[ScenarioResult], fmt: str = "rst", skipped: Sequence[tuple[str, str]] = ()
) -> str:
    body = rows(results) + [
        (title, "skipped: " + why, "", "", "", "", "") for title, why in skipped
    ]
    if fmt == "markdown":
        lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(HEADERS)]

    def line(char: str) -> str:
        return "+" + "+".join(char * (w + 2) for w in widths) + "+"

    def cells(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line("-"), cells(HEADERS), line("=")]
    for row in body:
        out += [cells(row), line("-")]
    return "\n".join(out)
