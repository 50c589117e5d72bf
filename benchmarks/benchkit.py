"""Output helpers shared by the benchmark scripts in this folder."""

from __future__ import annotations


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned, a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
