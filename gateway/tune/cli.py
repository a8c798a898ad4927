"""``specgate tune``: measure speculation on recorded traffic (or an operator's file), apply
the recommendation to a configuration file, and watch acceptance drift. Measuring and
applying are audit events (``tune_measure``, ``tune_apply``)."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gateway.cli_admin import DatabaseUrl, _cli_actor
from gateway.cli_privacy import content_stores

if TYPE_CHECKING:
    from gateway.settings import Settings

tune_app = typer.Typer(no_args_is_help=True)

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="The gateway's configuration (YAML), as `specgate serve`."),
]


def _settings(config: Path | None) -> Settings:
    from gateway.settings import ConfigError, load_settings

    try:
        return load_settings(config)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None


@tune_app.command("measure")
def measure(
    config: ConfigFile = None,
    requests: Annotated[
        Path | None,
        typer.Option(
            "--requests",
            help="JSON lines of OpenAI chat or completion request bodies to replay instead "
            "of the recorded traffic.",
        ),
    ] = None,
    since: Annotated[
        datetime | None, typer.Option(help="Recorded requests from this time (UTC unless stated).")
    ] = None,
    until: Annotated[datetime | None, typer.Option(help="... until this time (exclusive).")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Requests to replay (newest first).")] = 100,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="Cap on each request's tokens to generate.")
    ] = 64,
    k: Annotated[
        list[int] | None,
        typer.Option("--k", help="Fixed k to measure beside adaptive k; repeat (default 2, 4, 8)."),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per request and variant.")] = 1,
    include_held: Annotated[
        bool,
        typer.Option(help="Also replay subjects under a legal hold (left out by default)."),
    ] = False,
    out: Annotated[Path, typer.Option(help="Where tune.json and tune.html go.")] = Path(
        "tune-results"
    ),
    threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Replay a sample of this deployment's requests offline through plain decoding and every
    available method and k on each configured built-in target; report per workload cluster
    (route and key) tokens/s, latency, acceptance and the speedup with its interval, and
    recommend a method and k per model. Erased subjects' content is never read; the run is a
    `tune_measure` audit event naming the requests and subjects read, appended before any
    content is decrypted."""
    from gateway.audit.canonical import format_timestamp
    from gateway.audit.log import AuditUnavailableError
    from gateway.tune.measure import DEFAULT_KS, assign, configured_models, measure_model
    from gateway.tune.report import build_report, write_report
    from gateway.tune.sample import (
        RequestFileError,
        TuneRequest,
        choose_recorded,
        read_file,
        read_recorded,
    )

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    settings = _settings(config)
    models = configured_models(settings)
    if not models:
        typer.echo("error: no built-in model is configured (vLLM pools are not measured here)",
                   err=True)
        raise typer.Exit(2)
    ks = tuple(k or DEFAULT_KS)
    options: dict[str, Any] = {
        "ks": list(ks), "repeats": repeats, "max_tokens": max_tokens, "limit": limit,
    }
    skipped: Counter[str] = Counter()
    with content_stores(
        settings, database_url, "the audit log is not reachable ({detail}); nothing was read"
    ) as (_db, audit, privacy):
        payload: dict[str, Any] = {"options": options, "models": [m.name for m in models]}
        if requests is not None:
            try:
                chosen, sha256 = read_file(requests, limit)
            except (OSError, RequestFileError) as error:
                typer.echo(f"error: {error}", err=True)
                raise typer.Exit(2) from None
            source: dict[str, Any] = {"source": "file", "file": str(requests), "sha256": sha256}
            payload.update(source, subject_refs=[], request_ids=[r.source_id for r in chosen])
        else:
            candidates = choose_recorded(
                _db, privacy, limit=limit, since=since, until=until, include_held=include_held
            )
            skipped.update(candidates.skipped)
            source = {
                "source": "audit_log",
                "since": format_timestamp(since) if since else None,
                "until": format_timestamp(until) if until else None,
                "include_held": include_held,
            }
            payload.update(
                source,
                request_event_ids=candidates.event_ids,
                subject_refs=candidates.subject_refs,
                skipped=dict(candidates.skipped),
            )
        try:
            # Before any content is decrypted: a read that is not recorded cannot happen.
            event = audit.append("tune_measure", _cli_actor(), payload)
        except AuditUnavailableError as error:
            typer.echo(f"error: the run cannot be recorded, nothing was read: {error}", err=True)
            raise typer.Exit(1) from None
        if requests is None:
            recorded, unreadable = read_recorded(privacy, candidates)
            skipped.update(unreadable)
            chosen = recorded
    by_model, unassigned = assign(chosen, models)
    skipped.update(unassigned)
    runs = []
    for model in models:
        mine: list[TuneRequest] = by_model[model.name]
        if mine:
            runs.append(measure_model(model, mine, ks, repeats, max_tokens))
            skipped.update(runs[-1].skipped)
    source["requests_chosen"] = len(chosen)
    source["skipped"] = dict(skipped)
    report = build_report(runs, source, options, event.event_id)
    json_path, html_path, digest = write_report(report, out)
    for model_report in report["models"]:
        rec = model_report["recommendation"]
        if rec is not None:
            typer.echo(
                f"{model_report['name']}: {rec['verdict']}: method {rec['method']}, k "
                f"{rec['k']}, speedup {rec['speedup']:.2f}x "
                f"[{rec['speedup_low']:.2f}, {rec['speedup_high']:.2f}]"
            )
    typer.echo(f"wrote {json_path} (sha256 {digest}), {html_path}")


@tune_app.command("apply")
def apply(
    report: Annotated[Path, typer.Option("--report", help="tune.json from `tune measure`.")],
    config: Annotated[
        Path, typer.Option("--config", help="The configuration file to write the change to.")
    ],
    database_url: DatabaseUrl = None,
) -> None:
    """Write the report's recommendation (each measured model's method and k) into the
    configuration file, after checking that the result is a valid configuration; a
    `tune_apply` audit event records the change and the report's SHA-256. The file is
    rewritten as plain YAML (comments are not kept)."""
    import hashlib
    import os

    import yaml

    from gateway.audit.log import AuditUnavailableError
    from gateway.settings import ConfigError, load_settings
    from gateway.tune.recommend import ConfigChangeError, apply_to_config, snippet
    from gateway.tune.report import REPORT_KIND

    data = report.read_bytes()
    loaded = json.loads(data)
    if not isinstance(loaded, dict) or loaded.get("kind") != REPORT_KIND:
        typer.echo(f"error: {report} is not a `specgate tune measure` report", err=True)
        raise typer.Exit(2)
    document = yaml.safe_load(config.read_text()) if config.is_file() else None
    try:
        updated, change = apply_to_config(document, loaded)
    except ConfigChangeError as error:
        typer.echo(f"error: {config}: {error}", err=True)
        raise typer.Exit(2) from None
    partial = config.with_name(config.name + ".tune-new")
    partial.write_text(yaml.safe_dump(updated, sort_keys=False), "utf-8")
    try:
        settings = load_settings(partial)
    except ConfigError as error:
        partial.unlink()
        typer.echo(f"error: the changed configuration would be invalid: {error}", err=True)
        raise typer.Exit(2) from None
    digest = hashlib.sha256(data).hexdigest()
    with content_stores(
        settings, database_url, "the audit log is not reachable ({detail}); nothing was read"
    ) as (_db, audit, _privacy):
        try:
            appended = audit.append(
                "tune_apply",
                _cli_actor(),
                {
                    "report_sha256": digest,
                    "measure_event_id": loaded.get("measure_event_id"),
                    "config": str(config.resolve()),
                    "change": change,
                },
            )
        except AuditUnavailableError as error:
            partial.unlink()
            typer.echo(f"error: the change cannot be recorded, nothing written: {error}", err=True)
            raise typer.Exit(1) from None
    os.replace(partial, config)
    typer.echo(snippet(change), nl=False)
    typer.echo(f"wrote {config} (audit event {appended.event_id}, report sha256 {digest})")


@tune_app.command("watch")
def watch(
    report: Annotated[Path, typer.Option("--report", help="tune.json from `tune measure`.")],
    config: ConfigFile = None,
    window_tokens: Annotated[
        int, typer.Option(min=1, help="Draft tokens per model and method in the window.")
    ] = 2000,
    margin: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Drop below the measured acceptance allowed.")
    ] = 0.1,
    floor: Annotated[float, typer.Option(min=0.0, max=1.0, help="Acceptance floor.")] = 0.6,
    metrics_file: Annotated[
        Path | None,
        typer.Option(help="Write Prometheus gauges here (node-exporter textfile collector)."),
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Compare each method's rolling acceptance over the newest completions with what the
    report measured and with the floor: an `acceptance_drift` log line per drifting method,
    exit status 1 when any drifts (run it from cron or a Kubernetes CronJob)."""
    from gateway.db import make_db_engine
    from gateway.tune.watch import announce, drifts, rolling_acceptance, write_metrics

    settings = _settings(config)
    loaded = json.loads(report.read_text())
    db = make_db_engine(database_url or settings.database_url)
    try:
        found = drifts(rolling_acceptance(db, window_tokens), loaded, floor, margin)
    finally:
        db.dispose()
    announce(found)
    for drift in found:
        rate = drift.rolling
        expected = "-" if drift.expected is None else f"{drift.expected:.1%}"
        state = "DRIFT " + "; ".join(drift.reasons) if drift.drifting else "ok"
        typer.echo(
            f"{rate.model} {rate.method}: {rate.acceptance:.1%} over {rate.draft_tokens} draft "
            f"tokens ({rate.requests} requests), measured {expected}: {state}"
        )
    if metrics_file is not None:
        write_metrics(metrics_file, found)
    if any(drift.drifting for drift in found):
        raise typer.Exit(1)
