"""``specgate bench``: measure plain and speculative decoding side by side on one machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

DEFAULT_OUT = Path("bench/results")


def bench(
    target: Annotated[
        Path | None, typer.Option(help="Target model directory (default: the demo pair).")
    ] = None,
    draft: Annotated[
        Path | None, typer.Option(help="Draft model directory (default: the demo pair's).")
    ] = None,
    heads: Annotated[
        list[Path] | None,
        typer.Option(help="Medusa and/or EAGLE heads directories (specgate heads train); "
                     "repeat the option for both (default: the demo's medusa and eagle)."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSON lines of {'prompt': ...} or {'messages': [...]} requests; "
                     "replaces the built-in chat, code, editing and json sets."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where bench.json, bench.md, bench.png go.")] = (
        DEFAULT_OUT
    ),
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 96,
    repeats: Annotated[int, typer.Option(help="Timed runs per prompt and method.")] = 3,
    limit: Annotated[int, typer.Option(help="Prompts to take from each set.")] = 8,
    k: Annotated[int, typer.Option(help="The fixed K measured beside adaptive K.")] = 4,
    threads: Annotated[
        int | None,
        typer.Option(help="torch CPU threads for every method (default: torch's choice)."),
    ] = None,
) -> None:
    """Benchmark plain, n-gram, draft-model, Medusa and EAGLE decoding, and Hugging Face's
    equivalents."""
    from bench.constrained import measure
    from bench.report import summarise, write_outputs
    from bench.runner import BenchSetup, load_engines, run_bench
    from bench.workload import builtin_prompts, load_prompts
    from engine.training.demo.paths import default_demo_dir

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if target is None:
        demo = default_demo_dir()
        target = demo / "target"
        draft = draft or _built(demo / "draft")
        if heads is None:
            heads = [d for d in (demo / "medusa", demo / "eagle") if _built(d)]
    if not target.is_dir():
        raise typer.BadParameter(
            f"{target} is not a model directory; build the demo pair with "
            "`specgate models build-demo` or pass --target", param_hint="--target"
        )
    setup = BenchSetup(
        target=target, draft=draft, repeats=repeats, fixed_k=k, heads=tuple(heads or ())
    )
    engines = load_engines(setup)
    engine = engines[0]
    try:
        if prompts is None:
            workload = builtin_prompts(engine.tokenizer, max_tokens, limit)
        else:
            workload = load_prompts(prompts, prompts.stem, engine.tokenizer, max_tokens, limit)
        result = run_bench(setup, workload, engines)
        json_prompts = [p for p in workload if p.workload == "json"] or workload
        constrained = measure(engine, json_prompts[:limit], repeats, k)
    finally:
        for each in engines:
            each.close()
    rows = summarise(
        result.runs, result.variants, result.costs, result.divergences, result.extra_memory
    )
    paths = write_outputs(out, rows, result.header, result.costs, result.runs)
    lines = [line.text() for line in constrained]
    with paths["markdown"].open("a") as markdown:
        markdown.write("\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    typer.echo(paths["markdown"].read_text())
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")


def _built(directory: Path) -> Path | None:
    """``directory`` if a build left its config there (a demo part built), else None."""
    return directory if (directory / "config.json").is_file() else None
