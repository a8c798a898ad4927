"""``specgate serve``: run the gateway. Flags win over ``SPECGATE_*`` variables, which win over
the ``--config`` YAML file; with no flags at all it serves the demo pair with SQLite. The engine
knobs' help is their ``EngineConfig`` description (``gateway.knobs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.knobs import knob_help


def serve(
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML file; keys are setting names.")
    ] = None,
    target: Annotated[Path | None, typer.Option(help=knob_help("target"))] = None,
    draft: Annotated[Path | None, typer.Option(help=knob_help("draft"))] = None,
    heads: Annotated[Path | None, typer.Option(help=knob_help("heads"))] = None,
    method: Annotated[str | None, typer.Option(help=knob_help("method"))] = None,
    num_speculative_tokens: Annotated[
        int | None, typer.Option(help=knob_help("num_speculative_tokens"))
    ] = None,
    speculative_config: Annotated[
        str | None, typer.Option(help="vLLM-style --speculative-config JSON.")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help=knob_help("served_model_name"))
    ] = None,
    device: Annotated[str | None, typer.Option(help=knob_help("device"))] = None,
    dtype: Annotated[str | None, typer.Option(help=knob_help("dtype"))] = None,
    max_queue: Annotated[int | None, typer.Option(help=knob_help("max_queue"))] = None,
    cpu_threads: Annotated[int | None, typer.Option(help=knob_help("cpu_threads"))] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help=knob_help("max_num_seqs"))] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help=knob_help("max_num_batched_tokens"))
    ] = None,
    long_prefill_token_threshold: Annotated[
        int | None, typer.Option(help=knob_help("long_prefill_token_threshold"))
    ] = None,
    max_prefill_chunk_seconds: Annotated[
        float | None, typer.Option(help=knob_help("max_prefill_chunk_seconds"))
    ] = None,
    batch_invariant: Annotated[
        bool | None,
        typer.Option("--batch-invariant/--no-batch-invariant", help=knob_help("batch_invariant")),
    ] = None,
    max_kv_tokens: Annotated[int | None, typer.Option(help=knob_help("max_kv_tokens"))] = None,
    translate_draft_tokens: Annotated[
        bool | None,
        typer.Option(
            "--translate-draft-tokens/--no-translate-draft-tokens",
            help=knob_help("translate_draft_tokens"),
        ),
    ] = None,
    tool_call_parser: Annotated[
        str | None, typer.Option(help=knob_help("tool_call_parser"))
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(help="sqlite:///PATH or postgresql://... (default: SQLite in the data dir)."),
    ] = None,
    migrate: Annotated[
        bool | None,
        typer.Option("--migrate/--no-migrate", help="Run migrations on PostgreSQL at startup."),
    ] = None,
    backend: Annotated[
        str | None, typer.Option(help="local (built-in engine, default) or vllm.")
    ] = None,
    vllm_url: Annotated[
        list[str] | None,
        typer.Option(help="A vLLM server without speculation (plain pool); repeatable."),
    ] = None,
    vllm_speculative_url: Annotated[
        list[str] | None,
        typer.Option(help="A vLLM server started with --vllm-speculative-config; repeatable."),
    ] = None,
    vllm_speculative_config: Annotated[
        str | None, typer.Option(help="The speculative servers' --speculative-config JSON.")
    ] = None,
    vllm_model_version: Annotated[
        str | None, typer.Option(help="sha256:... of the weights the vLLM servers serve.")
    ] = None,
    vllm_model_dir: Annotated[
        Path | None,
        typer.Option(help="Model directory holding `specgate models hash DIR`'s manifest."),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8000).")] = None,
) -> None:
    """Serve the OpenAI-compatible API with auditing."""
    from gateway.settings import ConfigError, engine_config, load_settings, vllm_backend_from_flags

    try:
        backend_block = vllm_backend_from_flags(
            backend,
            plain_urls=vllm_url or [],
            speculative_urls=vllm_speculative_url or [],
            speculative_config=vllm_speculative_config,
            model_version=vllm_model_version,
            model_dir=vllm_model_dir,
        )
        settings = load_settings(
            config,
            backend=backend_block,
            target=target,
            draft=draft,
            heads=heads,
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            speculative_config=speculative_config,
            served_model_name=served_model_name,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_prefill_chunk_seconds=max_prefill_chunk_seconds,
            batch_invariant=batch_invariant,
            max_queue=max_queue,
            cpu_threads=cpu_threads,
            max_kv_tokens=max_kv_tokens,
            translate_draft_tokens=translate_draft_tokens,
            tool_call_parser=tool_call_parser,
            database_url=database_url,
            migrate=migrate,
            host=host,
            port=port,
        )
        if backend == "vllm" and settings.backend.kind != "vllm":
            raise ConfigError(
                "backend: --backend vllm needs --vllm-url/--vllm-speculative-url or a "
                "backend block with vllm_servers (YAML or SPECGATE_BACKEND)"
            )
        for model in settings.configured_models():
            if model.settings.backend.kind == "local":
                try:
                    engine_config(model.settings)
                except ConfigError as error:
                    raise model.located(error) from None
    except ConfigError as error:
        typer.echo(f"specgate serve: {error}", err=True)
        raise typer.Exit(2) from None

    from gateway.db import MigrationFailedError, normalise_url, upgrade_database

    url = normalise_url(settings.database_url)
    if settings.migrate or url.startswith("sqlite"):  # here, so a failure is one clear line
        try:
            upgrade_database(url)
        except MigrationFailedError as error:
            typer.echo(f"specgate serve: {error}", err=True)
            raise typer.Exit(2) from None

    from gateway.app import create_app
    from gateway.observability.logging import configure_logging

    configure_logging(
        log_format=settings.log_format, level=settings.log_level, log_content=settings.log_content
    )
    try:
        app = create_app(settings)
    except ValueError as error:  # an egress refusal or an unusable telemetry setting
        typer.echo(f"specgate serve: {error}", err=True)
        raise typer.Exit(2) from None
    from gateway.server import GracefulServer, bind, uvicorn_config

    try:
        listener = bind(settings)
    except OSError as error:
        where = f"{settings.host}:{settings.port}"
        typer.echo(f"specgate serve: cannot listen on {where}: {error}", err=True)
        raise typer.Exit(1) from None
    # uvicorn's own logging config and access log are off: its lines go through structlog
    # (same format, same redaction), and the request middleware logs each request with its ids.
    server_config = uvicorn_config(
        app, settings, log_level=settings.log_level, log_config=None, access_log=False
    )
    GracefulServer(server_config, app).run(sockets=[listener])
