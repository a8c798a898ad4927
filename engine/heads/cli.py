"""``specgate heads train``: self-distil draft heads on a frozen target."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

heads_app = typer.Typer(no_args_is_help=True)


@heads_app.command("train")
def train(
    target: Annotated[Path, typer.Option(help="Target model directory.")],
    out: Annotated[Path, typer.Option(help="Where to write the heads.")],
    method: Annotated[str, typer.Option(help="medusa | eagle")] = "medusa",
    data: Annotated[
        Path | None, typer.Option(help="Text directory to continue; default: the demo corpus.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 300,
    seed: Annotated[int, typer.Option(help="Seed of the data order and the heads.")] = 0,
    num_heads: Annotated[int, typer.Option(help="medusa_num_heads (Medusa only)")] = 4,
    snippets: Annotated[int, typer.Option(help="Prompts the target continues.")] = 256,
    rows_per_step: Annotated[
        int, typer.Option(help="Positions per step (EAGLE: of the token loss).")
    ] = 256,
) -> None:
    """Train heads on the target's own continuations; deterministic for a given seed."""
    if method not in ("medusa", "eagle"):
        raise typer.BadParameter(f"method {method!r}: heads are 'medusa' or 'eagle'")
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )

    from engine.heads.eagle import EagleDraft
    from engine.heads.medusa import MedusaHeads
    from engine.heads.train import HeadsSpec, corpus_texts, train_eagle, train_medusa
    from engine.loading import load_model, load_tokenizer
    from engine.versioning import model_version

    spec = HeadsSpec(
        num_heads=num_heads, steps=steps, seed=seed, snippets=snippets,
        rows_per_step=rows_per_step,
    )
    started = time.perf_counter()
    tokenizer = load_tokenizer(target)
    model = load_model(target, torch.device("cpu"), "float32")
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )
    with Progress(*columns) as progress:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: int, total: int, loss: float) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(f"{method} {phase}", total=total, detail="")
            progress.update(
                tasks[phase], completed=done, detail=f"loss {loss:.3f}" if loss else ""
            )

        texts, version = corpus_texts(data), model_version(target)
        heads: MedusaHeads | EagleDraft
        if method == "eagle":
            heads, losses = train_eagle(
                model, tokenizer, texts, spec, version, target.name, report
            )
        else:
            heads, losses = train_medusa(model, tokenizer, texts, spec, version, report)
    heads.save(out)
    summary = {
        "method": method,
        "target_model_version": heads.config.target_model_version,
        "extra_parameters": heads.extra_parameters(),
        "extra_share_of_target": heads.extra_parameters()
        / sum(p.numel() for p in model.parameters()),
        "losses": losses,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
