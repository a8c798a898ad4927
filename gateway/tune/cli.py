"""``specgate tune``: measure speculation on recorded traffic (or an operator's file), apply
the recommendation to a configuration file, and watch acceptance drift. Measuring and
applying are audit events (``tune_measure``, ``tune_apply``)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from engine.api.types import MAX_SPECULATIVE_TOKENS
from engine.training.heads import options
from gateway.cli_admin import DatabaseUrl, _cli_actor
from gateway.cli_privacy import content_stores
from gateway.tune.recommend import ACCEPTANCE_FLOOR
from gateway.tune.watch import DEFAULT_MARGIN, DEFAULT_WINDOW_TOKENS

if TYPE_CHECKING:
    from gateway.settings import Settings
    from gateway.tune.sample import Sample, Selection

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


def _audited_sample(
    settings: Settings,
    database_url: str | None,
    kind: str,
    payload: dict[str, Any],
    selection: Selection,
) -> Sample:
    """The run's sample, read after its ``kind`` audit event is appended
    (``gateway.tune.sample.audited_sample``); one-line errors, and nothing read, where the
    file cannot be read or the event cannot be appended."""
    from gateway.audit.log import AuditUnavailableError
    from gateway.tune.sample import RequestFileError, audited_sample

    with content_stores(
        settings, database_url, "the audit log is not reachable ({detail}); nothing was read"
    ) as (db, audit, privacy):
        try:
            return audited_sample(db, audit, privacy, kind, _cli_actor(), payload, selection)
        except (OSError, RequestFileError) as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(2) from None
        except AuditUnavailableError as error:
            typer.echo(f"error: the run cannot be recorded, nothing was read: {error}", err=True)
            raise typer.Exit(1) from None


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
    available method and k on each configured built-in target, and on each pool of each
    vLLM-served model (its servers as configured); report per workload cluster (route and
    key) tokens/s, latency, acceptance and the speedup with its interval, and recommend a
    method and k per model. Erased subjects' content is never read; the run is a
    `tune_measure` audit event naming the requests and subjects read, appended before any
    content is decrypted."""
    import httpx

    from gateway.tune.measure import (
        DEFAULT_KS,
        TuneModel,
        VllmModel,
        assign,
        configured_models,
        measure_model,
    )
    from gateway.tune.report import build_report, write_report
    from gateway.tune.sample import Selection, TuneRequest
    from gateway.tune.vllm_pools import (
        VllmReplayError,
        configured_vllm_models,
        measure_vllm_model,
    )

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    settings = _settings(config)
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        try:
            served = configured_vllm_models(settings, client)
        except VllmReplayError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(1) from None
        models: list[TuneModel | VllmModel] = [*configured_models(settings), *served]
        if not models:
            typer.echo("error: no model is configured", err=True)
            raise typer.Exit(2)
        ks = tuple(k or DEFAULT_KS)
        options: dict[str, Any] = {
            "ks": list(ks), "repeats": repeats, "max_tokens": max_tokens, "limit": limit,
        }
        selection = Selection(requests, limit, since, until, include_held)
        sample = _audited_sample(
            settings, database_url, "tune_measure",
            {"options": options, "models": [m.name for m in models]}, selection,
        )
        chosen, source, skipped = sample.requests, sample.source, sample.skipped
        by_model, unassigned = assign(chosen, models)
        skipped.update(unassigned)
        runs = []
        for model in models:
            mine: list[TuneRequest] = by_model[model.name]
            if not mine:
                continue
            try:
                runs.append(
                    measure_vllm_model(model, mine, repeats, max_tokens, client)
                    if isinstance(model, VllmModel)
                    else measure_model(model, mine, ks, repeats, max_tokens)
                )
            except VllmReplayError as error:
                typer.echo(f"error: {model.name}: {error}", err=True)
                raise typer.Exit(1) from None
            skipped.update(runs[-1].skipped)
    source["requests_chosen"] = len(chosen)
    source["skipped"] = dict(skipped)
    report = build_report(runs, source, options, sample.event.event_id)
    report["acceptance_drifts"] = _recorded_drifts(settings, database_url)
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


def _recorded_drifts(settings: Settings, database_url: str | None) -> list[dict[str, Any]]:
    """The gateway's newest recorded acceptance drifts, for the report's drift section."""
    from gateway.db import make_db_engine
    from gateway.tune.watch import recorded_drifts

    db = make_db_engine(database_url or settings.database_url)
    try:
        return recorded_drifts(db)
    finally:
        db.dispose()


@tune_app.command("train")
def train(
    config: Annotated[
        Path, typer.Option("--config", help="The gateway's configuration (YAML), as `specgate "
                           "serve`; --promote rewrites it.")
    ],
    method: Annotated[str, typer.Option(help="medusa | eagle | draft")] = "medusa",
    model_name: Annotated[
        str | None, typer.Option("--model", help="The model to train for (default: the one "
                                 "configured built-in model).")
    ] = None,
    requests: Annotated[
        Path | None,
        typer.Option(
            "--requests",
            help="JSON lines of OpenAI chat or completion request bodies to train and measure "
            "on instead of the recorded traffic.",
        ),
    ] = None,
    since: Annotated[
        datetime | None, typer.Option(help="Recorded requests from this time (UTC unless stated).")
    ] = None,
    until: Annotated[datetime | None, typer.Option(help="... until this time (exclusive).")] = None,
    limit: Annotated[int, typer.Option(min=2, help="Requests to read (newest first).")] = 200,
    include_held: Annotated[
        bool,
        typer.Option(help="Also read subjects under a legal hold (left out by default)."),
    ] = False,
    held_out: Annotated[
        float,
        typer.Option(min=0.01, max=0.99, help="Share of the requests held out to measure on."),
    ] = 0.25,
    seed: Annotated[int, typer.Option(help="Seed of the split, the data order and the heads.")] = 0,
    steps: options.Steps = options.STEPS,
    num_heads: options.NumHeads = options.NUM_HEADS,
    answer_tokens: options.AnswerTokens = options.ANSWER_TOKENS,
    generation_batch: options.GenerationBatch = options.GENERATION_BATCH,
    draft_vocab_size: options.DraftVocabSize = options.DRAFT_VOCAB_SIZE,
    rows_per_step: options.RowsPerStep = options.ROWS_PER_STEP,
    sequences_per_step: options.SequencesPerStep = options.SEQUENCES_PER_STEP,
    lr: options.LearningRate = options.LEARNING_RATE,
    draft_layer: Annotated[
        list[int] | None,
        typer.Option("--draft-layer", help="A target layer the draft starts from, repeated in "
                     "order (draft only; default: the demo draft's)."),
    ] = None,
    draft_head_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens the draft's head scores, the target's most written "
                     "(draft only; default: the demo draft's)."),
    ] = None,
    k: Annotated[
        int,
        typer.Option("--k", min=1, max=MAX_SPECULATIVE_TOKENS,
                     help="The fixed k the held-out requests are measured at."),
    ] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per held-out request.")] = 1,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="Cap on each held-out request's tokens to generate.")
    ] = 64,
    promote: Annotated[
        bool,
        typer.Option(help="Point the configuration at the new artefact if it is better on the "
                     "held-out requests (a `tune_promote` event either way)."),
    ] = False,
    keep_cache: Annotated[
        bool,
        typer.Option(help="Keep the target's answers (OUT/cache) after the run; by default "
                     "they go once the run is done (a failed run keeps them to resume)."),
    ] = False,
    out: Annotated[
        Path, typer.Option(help="Where the artefact, provenance.json and train.json go.")
    ] = Path("tune-train"),
    threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Retrain Medusa heads, an EAGLE draft or a draft model on the target's own answers to
    a sample of this deployment's requests, and compare them on held-out requests with plain
    decoding and the configured artefact of that method. The run is a `tune_train` audit event
    naming the requests and subjects read, appended before any content is decrypted; erased
    subjects' content is never read. With --promote the configuration points at the new
    artefact only if its held-out acceptance and speedup beat the current one's (or, without
    one, plain decoding). The draft model takes --steps, --answer-tokens, --generation-batch
    and --lr, and its own recipe otherwise (engine.training.demo.draft.DraftSpec)."""
    import shutil

    import yaml

    from engine.training.heads.cli import training_progress
    from gateway.tune.measure import configured_models
    from gateway.tune.recommend import ConfigChangeError, set_model_settings
    from gateway.tune.sample import Selection
    from gateway.tune.train import (
        CACHE_DIR,
        PROVENANCE_FILE,
        TuneMethod,
        compare,
        promotion,
        recipe,
        retrain,
        training_spec,
    )

    methods: dict[str, TuneMethod] = {"medusa": "medusa", "eagle": "eagle", "draft": "draft"}
    if method not in methods:
        typer.echo(f"error: --method {method!r}: 'medusa', 'eagle' or 'draft'", err=True)
        raise typer.Exit(2)
    kind = methods[method]
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    settings = _settings(config)
    models = configured_models(settings)
    if model_name is None:
        model = models[0] if len(models) == 1 else None
    else:
        model = next((m for m in models if m.serves(model_name)), None)
    if model is None:
        names = ", ".join(m.name for m in models) or "none"
        typer.echo(
            f"error: name the built-in model to train for with --model (configured: {names})",
            err=True,
        )
        raise typer.Exit(2)
    spec = training_spec(
        kind, steps=steps, answer_tokens=answer_tokens, generation_batch=generation_batch,
        lr=lr, seed=seed, num_heads=num_heads, rows_per_step=rows_per_step,
        sequences_per_step=sequences_per_step, draft_vocab_size=draft_vocab_size,
        draft_layers=draft_layer or (), draft_head_tokens=draft_head_tokens,
    )  # fmt: skip
    options: dict[str, Any] = {
        "limit": limit, "k": k, "repeats": repeats, "max_tokens": max_tokens,
        "promote": promote, "recipe": recipe(spec, kind, held_out),
    }
    sample = _audited_sample(
        settings, database_url, "tune_train",
        {"options": options, "model": model.name, "method": kind},
        Selection(requests, limit, since, until, include_held),
    )
    try:
        with training_progress(kind) as progress:
            retraining = retrain(model, kind, sample, spec, held_out, out, progress)
        trained = retraining.trained
        summary = trained.summary
        typer.echo(
            f"trained on {len(trained.trained_on)} requests: {summary['answers_generated']} "
            f"answers generated, {summary['answers_read_back']} read back from "
            f"{out / CACHE_DIR}"
        )
        comparison = compare(model, kind, retraining, out, k, repeats, max_tokens)
    except ValueError as error:  # too few requests, nothing to learn from or to replay
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    for row in comparison.report["rows"]:
        typer.echo(
            f"{row['artefact']}: {row['variant']}: acceptance {row['acceptance_rate']}, mean "
            f"accepted length {row['mean_accepted_length']}, {row['tokens_per_second']} "
            f"tokens/s, speedup {row['speedup']:.2f}x"
        )
    decision = comparison.verdict
    json_path, html_path = comparison.paths
    typer.echo(f"{'better' if decision['better'] else 'not better'}: {decision['reason']}")
    typer.echo(f"wrote {trained.directory}, {out / PROVENANCE_FILE}, {json_path} "
               f"(sha256 {comparison.report_sha256}), {html_path}")
    if promote:
        evidence, change = promotion(model, kind, sample, retraining, comparison)
        if change is not None:
            document = yaml.safe_load(config.read_text())
            try:
                updated, written = set_model_settings(document, {model.name: change})
            except ConfigChangeError as error:
                typer.echo(f"error: {config}: {error}", err=True)
                raise typer.Exit(2) from None
            event_id = _rewrite_config(
                config, updated, database_url, "tune_promote",
                {**evidence, "promoted": True, "change": written},
            )
            typer.echo(f"promoted: {config} now serves {trained.directory} (audit event "
                       f"{event_id})")
        else:
            event_id = _record(
                settings, database_url, "tune_promote", {**evidence, "promoted": False}
            )
            typer.echo(f"not promoted: the configuration is unchanged (audit event {event_id})")
    if not keep_cache:
        shutil.rmtree(out / CACHE_DIR, ignore_errors=True)


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

    import yaml

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
    digest = hashlib.sha256(data).hexdigest()
    event_id = _rewrite_config(
        config, updated, database_url, "tune_apply",
        {
            "report_sha256": digest,
            "measure_event_id": loaded.get("measure_event_id"),
            "change": change,
        },
    )
    typer.echo(snippet(change), nl=False)
    typer.echo(f"wrote {config} (audit event {event_id}, report sha256 {digest})")


def _record(
    settings: Settings, database_url: str | None, kind: str, payload: dict[str, Any]
) -> str:
    """Append a ``kind`` audit event; its id. One-line error and exit 1 where it cannot be
    appended."""
    from gateway.audit.log import AuditUnavailableError

    with content_stores(
        settings, database_url, "the audit log is not reachable ({detail}); nothing was written"
    ) as (_db, audit, _privacy):
        try:
            return audit.append(kind, _cli_actor(), payload).event_id
        except AuditUnavailableError as error:
            typer.echo(f"error: the change cannot be recorded, nothing written: {error}", err=True)
            raise typer.Exit(1) from None


def _rewrite_config(
    config: Path, updated: dict[str, Any], database_url: str | None, kind: str,
    payload: dict[str, Any],
) -> str:
    """Replace ``config`` by ``updated`` (plain YAML: comments go) once it is checked to be a
    valid configuration and the change is appended as a ``kind`` audit event (``payload`` and
    the file's path); the event's id. Nothing is written where either fails."""
    import os

    import yaml

    from gateway.settings import ConfigError, load_settings

    partial = config.with_name(config.name + ".tune-new")
    partial.write_text(yaml.safe_dump(updated, sort_keys=False), "utf-8")
    try:
        try:
            settings = load_settings(partial)
        except ConfigError as error:
            typer.echo(f"error: the changed configuration would be invalid: {error}", err=True)
            raise typer.Exit(2) from None
        event_id = _record(
            settings, database_url, kind, {**payload, "config": str(config.resolve())}
        )
        os.replace(partial, config)
        return event_id
    finally:
        partial.unlink(missing_ok=True)


@tune_app.command("watch")
def watch(
    report: Annotated[Path, typer.Option("--report", help="tune.json from `tune measure`.")],
    config: ConfigFile = None,
    window_tokens: Annotated[
        int, typer.Option(min=1, help="Draft tokens per model and method in the window.")
    ] = DEFAULT_WINDOW_TOKENS,
    margin: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Drop below the measured acceptance allowed.")
    ] = DEFAULT_MARGIN,
    floor: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Acceptance floor.")
    ] = ACCEPTANCE_FLOOR,
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
