"""``specgate heads train``: self-distil draft heads on a frozen target."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from engine.training.heads import options

if TYPE_CHECKING:
    from engine.training.heads.train import Progress

heads_app = typer.Typer(no_args_is_help=True)


@contextmanager
def training_progress(label: str) -> Iterator[Progress]:
    """A progress callback for ``build_data`` and the training loops: one bar per phase
    (answers, features, training), with the loss where there is one."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as Bars

    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )
    with Bars(*columns) as bars:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: int, total: int, loss: float) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(f"{label} {phase}", total=total, detail="")
            bars.update(tasks[phase], completed=done, detail=f"loss {loss:.3f}" if loss else "")

        yield report


@heads_app.command("train")
def train(
    target: Annotated[Path, typer.Option(help="Target model directory.")],
    out: Annotated[Path, typer.Option(help="Where to write the heads.")],
    method: Annotated[str, typer.Option(help="medusa | eagle")] = "medusa",
    data: Annotated[
        Path | None,
        typer.Option(help="Text directory whose snippets the target continues; default: the "
                     "target answers the demo's distillation prompts."),
    ] = None,
    steps: options.Steps = options.STEPS,
    seed: Annotated[int, typer.Option(help="Seed of the data order and the heads.")] = 0,
    num_heads: options.NumHeads = options.NUM_HEADS,
    prompts: Annotated[
        int, typer.Option(help="Demo distillation prompts the target answers (without --data).")
    ] = 320,
    snippets: Annotated[
        int | None,
        typer.Option(help="Text snippets the target continues (default: 256 with --data, "
                     "none without)."),
    ] = None,
    answer_tokens: options.AnswerTokens = options.ANSWER_TOKENS,
    generation_batch: options.GenerationBatch = options.GENERATION_BATCH,
    draft_vocab_size: options.DraftVocabSize = options.DRAFT_VOCAB_SIZE,
    rows_per_step: options.RowsPerStep = options.ROWS_PER_STEP,
    sequences_per_step: options.SequencesPerStep = options.SEQUENCES_PER_STEP,
    lr: options.LearningRate = options.LEARNING_RATE,
    held_out: Annotated[
        float,
        typer.Option(help="Share of the sequences held out to measure each Medusa head's top-1 "
                     "accuracy on (0: train on all)."),
    ] = 0.0,
    cache: Annotated[
        Path | None,
        typer.Option(help="Where the target's answers are cached, keyed by its version and "
                     "the prompts (default: --out); give both methods one to answer once."),
    ] = None,
) -> None:
    """Train heads on the target's own answers; deterministic for a given seed."""
    if method not in ("medusa", "eagle"):
        raise typer.BadParameter(f"method {method!r}: heads are 'medusa' or 'eagle'")
    import torch

    from engine.models.loading import load_model, load_tokenizer
    from engine.models.versioning import model_version
    from engine.training.heads.eagle import EagleDraft
    from engine.training.heads.medusa import MedusaHeads
    from engine.training.heads.train import (
        HeadsSpec,
        build_data,
        corpus_texts,
        demo_chats,
        medusa_accuracy,
        split_sequences,
        train_eagle,
        train_medusa,
    )

    spec = HeadsSpec(
        num_heads=num_heads, steps=steps, seed=seed,
        snippets=(256 if data is not None else 0) if snippets is None else snippets,
        answer_tokens=answer_tokens, generation_batch=generation_batch,
        rows_per_step=rows_per_step, sequences_per_step=sequences_per_step, lr=lr,
        warmup_steps=min(50, steps // 10), draft_vocab_size=draft_vocab_size or None,
    )
    started = time.perf_counter()
    tokenizer = load_tokenizer(target)
    model = load_model(target, torch.device("cpu"), "float32")
    with training_progress(method) as report:
        version = model_version(target)
        texts = corpus_texts(data) if spec.snippets else []
        chats = demo_chats(prompts, seed) if data is None else []
        distilled = build_data(
            model, tokenizer, texts, spec, version, report, chats=chats,
            cache_dir=cache or out,
        )
        data_seconds = time.perf_counter() - started
        heads: MedusaHeads | EagleDraft
        eos = tokenizer.eos_token_id
        accuracy: dict[str, list[float]] = {}
        if method == "eagle":
            heads, losses = train_eagle(
                model, distilled, spec, version, target.name, report, eos=eos
            )
        elif held_out > 0:
            trained_on, kept_out = split_sequences(distilled, held_out)
            heads, losses = train_medusa(model, trained_on, spec, version, report, eos=eos)
            accuracy["held_out_top1_per_head"] = medusa_accuracy(heads, kept_out)
        else:
            heads, losses = train_medusa(model, distilled, spec, version, report, eos=eos)
    heads.save(out)
    target_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    summary = {
        "method": method,
        "target_model_version": heads.config.target_model_version,
        "draft_vocab_size": heads.config.draft_vocab_size,
        "sequences": int(distilled.ids.shape[0]),
        "positions": distilled.positions,
        "extra_parameters": heads.extra_parameters(),
        "extra_memory_share_of_target": round(heads.extra_bytes() / target_bytes, 4),
        **accuracy,
        "losses": losses,
        "data_seconds": round(data_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
