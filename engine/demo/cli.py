"""``specgate models``: build the demo model pair."""

from __future__ import annotations

import os
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
    quick: Annotated[
        bool, typer.Option(help="Tiny models in seconds, for CI and tests (they write noise).")
    ] = False,
    if_missing: Annotated[
        bool, typer.Option(help="Do nothing when a built pair is already there.")
    ] = False,
) -> None:
    """Train the demo tokenizer, target and draft on the Python standard library."""
    # Spinning OpenMP threads collapse throughput when the cores are shared with other work
    # (measured: 85 vs 700 tokens/s training on 2 busy cores); must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine.demo.build import QUICK, build_demo, full_spec
    from engine.demo.paths import default_demo_dir

    target_dir = out or default_demo_dir()
    if if_missing and all((target_dir / m / "config.json").is_file() for m in ("target", "draft")):
        typer.echo(f"demo pair already built in {target_dir}")
        return
    manifest = build_demo(target_dir, QUICK if quick else full_spec())
    seconds = manifest["seconds"]
    evaluation = manifest["evaluation"]
    assert isinstance(seconds, dict) and isinstance(evaluation, dict)
    typer.echo(
        f"built {target_dir}/target and {target_dir}/draft in {seconds['total']:.0f} s; "
        f"held-out loss target {evaluation['target_held_out_loss']}, "
        f"draft {evaluation['draft_held_out_loss']}, "
        f"greedy agreement {evaluation['greedy_agreement']}"
    )
