"""The tuning report: JSON (figures, recommendations, the requests measured by id) and one
self-contained HTML page (tables and an inline SVG chart; no script, nothing fetched)."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

from gateway.tune.measure import ALL, ModelRun, VllmModel, figures, machine
from gateway.tune.recommend import ACCEPTANCE_FLOOR, recommend

REPORT_KIND = "specgate-tune-report"


def build_report(
    runs: list[ModelRun], source: dict[str, Any], options: dict[str, Any], event_id: str
) -> dict[str, Any]:
    """The report's JSON: per model, its clusters' figures and recommendations; the model's
    own recommendation is its ``all`` cluster's."""
    models = []
    measured = []
    for run in runs:
        clusters = figures(run) if run.prompts else []
        for cluster in clusters:
            cluster["recommendation"] = recommend(cluster["rows"])
        whole = next((c for c in clusters if c["cluster"] == ALL), None)
        served: dict[str, Any] = {"backend": "local"}
        if isinstance(run.model, VllmModel):
            # The pools as configured: a running server's k cannot be varied.
            served = {
                "backend": "vllm",
                "pools": [
                    {"url": p.url, "method": p.method, "speculative_config": p.speculative_config}
                    for p in run.model.pools
                ],
            }
        models.append(
            {
                "name": run.model.name,
                **served,
                "target": str(run.model.target),
                "target_version": run.target_version,
                "dtype": run.dtype,
                "methods": ["none", *run.methods],
                "requests": len(run.prompts),
                "skipped": dict(run.skipped),
                "clusters": clusters,
                "recommendation": whole["recommendation"] if whole else None,
            }
        )
        measured += [
            {"id": p.name, "model": run.model.name, "cluster": p.workload} for p in run.prompts
        ]
    return {
        "kind": REPORT_KIND,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "measure_event_id": event_id,
        "source": source,
        "options": options,
        "machine": machine(),
        "models": models,
        "requests": measured,
    }


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path, str]:
    """``tune.json`` and ``tune.html`` in ``out``; returns their paths and the JSON's
    SHA-256 (what `tune apply` records as the evidence)."""
    out.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(report, indent=2) + "\n").encode("utf-8")
    json_path, html_path = out / "tune.json", out / "tune.html"
    json_path.write_bytes(data)
    html_path.write_text(render_html(report), "utf-8")
    return json_path, html_path, hashlib.sha256(data).hexdigest()


# --- HTML ---------------------------------------------------------------------------------

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px;margin-bottom:4px}
table{border-collapse:collapse;margin:6px 0 14px}td,th{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}
.on{color:#196b24;font-weight:600}.off{color:#a11;font-weight:600}.no_gain_shown{color:#8a6d00;
font-weight:600}.low{color:#a11}.note{color:#555}
"""


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "&ndash;"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return escape(str(value))


def _pct(value: float | None) -> str:
    if value is None:
        return "&ndash;"
    css = ' class="low"' if value < ACCEPTANCE_FLOOR else ""
    return f"<span{css}>{value:.1%}</span>"


def _recommendation_line(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return '<p class="note">no request measured</p>'
    k = f", k = {escape(str(rec['k']))}" if rec["method"] != "none" else ""
    text = (
        f'<p><span class="{rec["verdict"]}">{escape(rec["verdict"])}</span>: serve with '
        f"<b>{escape(rec['method'])}</b>{k}; expected speedup {rec['speedup']:.2f}&times; "
        f"(95 % interval {rec['speedup_low']:.2f}&ndash;{rec['speedup_high']:.2f}, best measured: "
        f"{escape(rec['best_measured'])})</p>"
    )
    return text + "".join(f'<p class="note">{escape(a)}</p>' for a in rec["advice"])


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "<tr><th>variant</th><th>tokens/s</th><th>speedup</th><th>95 % interval</th>"
        "<th>latency p50 (s)</th><th>p90</th><th>p99</th><th>acceptance</th>"
        "<th>mean accepted length</th><th>tokens</th></tr>"
    )
    body = "".join(
        f"<tr><td>{escape(r['variant'])}</td><td>{_fmt(r['tokens_per_second'], 1)}</td>"
        f"<td>{r['speedup']:.2f}&times;</td><td>{r['speedup_low']:.2f}&ndash;{r['speedup_high']:.2f}</td>"
        f"<td>{_fmt(r['latency_p50_s'])}</td><td>{_fmt(r['latency_p90_s'])}</td>"
        f"<td>{_fmt(r['latency_p99_s'])}</td><td>{_pct(r['acceptance_rate'])}</td>"
        f"<td>{_fmt(r['mean_accepted_length'], 2)}</td><td>{r['tokens']}</td></tr>"
        for r in rows
    )
    return f"<table>{head}{body}</table>"


# Width of a character of the chart's 12 px labels, at most (system-ui sans-serif).
LABEL_CHAR_PX = 7


def speedup_chart(rows: list[dict[str, Any]]) -> str:
    """Horizontal bars of each variant's speedup with its interval as a whisker, and the
    line at 1 (plain decoding). The labels' column is as wide as the longest label."""
    bar_h, gap, width = 18, 6, 520
    left = max(130, LABEL_CHAR_PX * max(len(row["variant"]) for row in rows) + 12)
    top = max([r["speedup_high"] for r in rows] + [1.2]) * 1.05
    height = len(rows) * (bar_h + gap) + 30

    def x(value: float) -> float:
        return left + width * value / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" '
        f'height="{height}" role="img" aria-label="speedup over plain decoding">'
    ]
    for index, row in enumerate(rows):
        y = 4 + index * (bar_h + gap)
        colour = "#999" if row["method"] == "none" else (
            "#2a7ab0" if row["speedup_low"] > 1.0 else "#c0504d" if row["speedup_high"] < 1.0
            else "#d9a400"
        )
        parts.append(
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" font-size="12">'
            f"{escape(row['variant'])}</text>"
            f'<rect x="{left}" y="{y}" width="{x(row["speedup"]) - left:.1f}" height="{bar_h}" '
            f'fill="{colour}"/>'
            f'<line x1="{x(row["speedup_low"]):.1f}" x2="{x(row["speedup_high"]):.1f}" '
            f'y1="{y + bar_h / 2}" y2="{y + bar_h / 2}" stroke="#222" stroke-width="1.5"/>'
            f'<text x="{x(max(row["speedup"], row["speedup_high"])) + 4:.1f}" y="{y + 13}" '
            f'font-size="11">{row["speedup"]:.2f}&times;</text>'
        )
    axis_y = len(rows) * (bar_h + gap) + 4
    parts.append(
        f'<line x1="{x(1.0):.1f}" x2="{x(1.0):.1f}" y1="0" y2="{axis_y}" stroke="#222" '
        f'stroke-dasharray="4 3"/><text x="{x(1.0):.1f}" y="{axis_y + 16}" font-size="11" '
        'text-anchor="middle">1&times; (plain)</text></svg>'
    )
    return "".join(parts)


def render_html(report: dict[str, Any]) -> str:
    source = report["source"]
    skipped = source.get("skipped") or {}
    skipped_text = ", ".join(f"{escape(k)}: {v}" for k, v in sorted(skipped.items())) or "none"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>Specgate speculation tuning</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Speculation on this traffic</h1>",
        f"<p>{len(report['requests'])} requests replayed from "
        f"{escape(str(source.get('source')))}; left out: {skipped_text}. "
        f"Options: {escape(json.dumps(report['options']))}. Machine: "
        f"{escape(report['machine'])}. Audit event {escape(report['measure_event_id'])}; "
        f"made {escape(report['created_at'])}.</p>",
    ]
    for model in report["models"]:
        parts.append(
            f"<h2>Model {escape(model['name'])}</h2><p class='note'>{escape(model['target'])} "
            f"({escape(model['target_version'][:19])}…, {escape(model['dtype'])}); methods "
            f"{escape(', '.join(model['methods']))}; {model['requests']} requests</p>"
        )
        if model.get("backend") == "vllm":
            parts.append(
                "<p class='note'>Served by vLLM: each pool measured on its server as "
                "configured (k cannot be varied on a running server).</p>"
            )
        parts.append(_recommendation_line(model["recommendation"]))
        for cluster in model["clusters"]:
            if cluster["cluster"] == ALL:
                parts.append(speedup_chart(cluster["rows"]))
            parts.append(
                f"<h3>{escape(cluster['cluster'])} ({cluster['requests']} requests)</h3>"
            )
            if cluster["cluster"] != ALL:
                parts.append(_recommendation_line(cluster["recommendation"]))
            parts.append(_table(cluster["rows"]))
    parts.append(_drifts(report.get("acceptance_drifts", [])))
    parts.append(
        "<p class='note'>Speedup: tokens/s over plain decoding on the same requests; interval: "
        "95 % bootstrap over requests. Latency: per request, median over repeats. Acceptance "
        f"under {ACCEPTANCE_FLOOR:.0%} in red.</p></body></html>"
    )
    return "".join(parts)


def _drifts(drifts: list[dict[str, Any]]) -> str:
    """The gateway's recorded acceptance drifts, newest first, one line each."""
    if not drifts:
        return "<h2>Acceptance drift</h2><p class='note'>No drift recorded by the gateway.</p>"
    lines = "".join(
        f"<li>{escape(d.get('created_at', ''))}: {escape(str(d.get('model')))} "
        f"{escape(str(d.get('method')))} {escape(str(d.get('workload', 'all')))}, rolling "
        f"acceptance {_fmt(d.get('rolling_acceptance'))}: {escape(str(d.get('reason')))}</li>"
        for d in drifts
    )
    return (
        f"<h2 id='acceptance-drift'>Acceptance drift</h2><p>{len(drifts)} drift(s) recorded "
        "by the gateway, newest first; where a workload's acceptance has moved from what was "
        "measured, measure it again, or retrain its proposer with <code>specgate tune "
        f"train</code>:</p><ul>{lines}</ul>"
    )


def write_train_report(report: dict[str, Any], out: Path) -> tuple[Path, Path, str]:
    """``train.json`` and ``train.html`` in ``out``; returns their paths and the JSON's
    SHA-256 (what the `tune_promote` event records as the evidence)."""
    out.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(report, indent=2) + "\n").encode("utf-8")
    json_path, html_path = out / "train.json", out / "train.html"
    json_path.write_bytes(data)
    html_path.write_text(render_train_html(report), "utf-8")
    return json_path, html_path, hashlib.sha256(data).hexdigest()


def render_train_html(report: dict[str, Any]) -> str:
    """The held-out comparison of `tune train` as one self-contained page."""
    rows = report["rows"]
    named = [{**row, "variant": f"{row['artefact']}: {row['variant']}"} for row in rows]
    decision = report["verdict"]
    css = "on" if decision["better"] else "off"
    word = "better" if decision["better"] else "not better"
    artefacts = "".join(
        f"<li>{escape(name)}: <code>{escape(path)}</code></li>"
        for name, path in report["artefacts"].items()
    )
    return "".join(
        [
            "<!doctype html><html><head><meta charset='utf-8'>",
            "<title>Specgate heads retrained on this traffic</title>",
            f"<style>{_STYLE}</style></head><body>",
            f"<h1>{escape(report['method'])} heads retrained for {escape(report['model'])}</h1>",
            f"<p>{len(report['held_out']['requests'])} held-out requests; options "
            f"{escape(json.dumps(report['options']))}; machine {escape(report['machine'])}; "
            f"audit event {escape(report['train_event_id'])}; made "
            f"{escape(report['created_at'])}.</p><ul>{artefacts}</ul>",
            f"<p><span class='{css}'>{word}</span>: {escape(decision['reason'])}</p>",
            speedup_chart(named),
            _table(named),
            "<p class='note'>Speedup: tokens/s over plain decoding on the same held-out "
            "requests; interval: 95 % bootstrap over requests. Acceptance under "
            f"{ACCEPTANCE_FLOOR:.0%} in red.</p></body></html>",
        ]
    )
