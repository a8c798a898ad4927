"""The HTML pieces of the compliance report: tables, figures with their source, notices and
inline SVG charts. Everything is escaped here; the page has no script and loads nothing."""

from __future__ import annotations

import html
import io
from datetime import datetime
from typing import Any

STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 62em; }
h1 { font-size: 1.6em; margin-bottom: 0.1em; } .subtitle { color: #555; margin-top: 0; }
h2 { font-size: 1.3em; margin-top: 1.8em; border-bottom: 2px solid #444; }
h3 { font-size: 1.05em; margin-top: 1.3em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; overflow-wrap: anywhere;
  vertical-align: top; }
th { background: #f0f0f0; white-space: nowrap; }
table.facts th { width: 14em; white-space: normal; }
.figure { font-size: 1.6em; font-weight: bold; } .source { font-size: 0.75em; color: #555; }
.ok { color: #2e7d32; font-weight: bold; } .bad { color: #c62828; font-weight: bold; }
.empty { color: #777; font-style: italic; } .cards { display: flex; flex-wrap: wrap; gap: 1.2em; }
.card { border: 1px solid #ccc; padding: 0.4em 0.8em; min-width: 10em; max-width: 16em; }
.warning { background: #fdecea; border: 2px solid #c62828; color: #8e0000; padding: 0.6em 0.9em;
  margin: 0.5em 0; font-weight: bold; }
.notice { background: #fff8e1; border: 1px solid #f9a825; padding: 0.5em 0.9em; margin: 0.5em 0; }
.version { background: #eef3fb; border: 1px solid #3465a4; padding: 0.5em 0.9em; }
"""


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def table(headers: list[str], rows: list[list[Any]], empty: str, ident: str = "") -> str:
    if not rows:
        return f"<p class='empty'>{esc(empty)}</p>"
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    attribute = f" id='{ident}'" if ident else ""
    return f"<table{attribute}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def facts(rows: list[tuple[str, Any]]) -> str:
    """A two-column table of labelled values (the page head, a party)."""
    body = "".join(f"<tr><th>{esc(label)}</th><td>{esc(value)}</td></tr>" for label, value in rows)
    return f"<table class='facts'><tbody>{body}</tbody></table>"


def card(label: str, ident: str, value: Any, source: str) -> str:
    """One figure, with the events it was counted from."""
    return (
        f"<div class='card'>{esc(label)}<div class='figure' id='{ident}'>{esc(value)}</div>"
        f"<div class='source'>Source: {esc(source)}</div></div>"
    )


def source(text: str) -> str:
    return f"<p class='source'>Source: {esc(text)}</p>"


def warning(ident: str, text: str) -> str:
    return f"<p class='warning' id='{ident}'>{esc(text)}</p>"


def notice(ident: str, text: str) -> str:
    return f"<p class='notice' id='{ident}'>{esc(text)}</p>"


def svg_chart(title: str, series: dict[datetime, float], ylabel: str, kind: str = "bar") -> str:
    """A small chart as inline SVG (no fonts or scripts fetched)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, no glyph paths
    figure, axes = plt.subplots(figsize=(7.5, 2.6), dpi=100)
    try:
        slots = sorted(series)
        labels = [slot.strftime("%m-%d %H:%M") for slot in slots]
        values = [series[slot] for slot in slots]
        if kind == "bar":
            axes.bar(range(len(values)), values, color="#3465a4")
            axes.set_ylim(0, max([1.0, *values]) * 1.1)
        else:
            axes.plot(range(len(values)), values, marker="o", color="#4e9a06")
            axes.set_ylim(0, 1)
        axes.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
        axes.set_title(title, fontsize=10)
        axes.set_ylabel(ylabel, fontsize=8)
        axes.grid(axis="y", alpha=0.3)
        figure.tight_layout()
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg")
    finally:
        plt.close(figure)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]
