"""``specgate generate``: one request through the engine, without the gateway."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from engine.training.demo.cli import models_app

__all__ = ["generate", "models_app"]


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers, e.g. 1,2,3") from None


def generate(
    target: Annotated[Path, typer.Option(help="Target model directory (Hugging Face format).")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    draft: Annotated[Path | None, typer.Option(help="Draft model directory.")] = None,
    heads: Annotated[
        Path | None, typer.Option(help="Medusa or EAGLE heads directory (specgate heads train).")
    ] = None,
    method: Annotated[
        str,
        typer.Option(help="A registered method (engine.speculation.methods); none: plain."),
    ] = "none",
    num_speculative_tokens: Annotated[
        int | None, typer.Option(help="Fixed k; adaptive when left out.")
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Prompt as token ids: 1,2,3")] = None,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeatable.")] = None,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float16 | float32")] = "auto",
    device: Annotated[
        str | None, typer.Option(help="cuda, cpu, ...; default: CUDA if present")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate from a prompt with plain or speculative decoding."""
    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt and --prompt-ids")
    from engine.api.types import EngineError, GenerationRequest, SamplingParams, SpeculativeChoice
    from engine.config import EngineConfig, SpeculativeConfig
    from engine.serving.service import Engine

    try:
        config = EngineConfig(
            target=target,
            draft=draft,
            heads=heads,
            dtype=dtype,  # type: ignore[arg-type]
            device=device,
            speculative=SpeculativeConfig(
                method=method,
                num_speculative_tokens=num_speculative_tokens,
                # One request: a fallback switch could only slow it down, never help.
                acceptance_threshold=0.0,
                min_speedup=0.0,
            ),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        engine = Engine.load(config)
    except EngineError as exc:  # a draft or heads that do not fit the target, named
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        ids = (
            _parse_ids(prompt_ids)
            if prompt_ids is not None
            else tuple(engine.tokenizer.encode(prompt or ""))
        )
        request = GenerationRequest(
            ids,
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=tuple(stop or ()),
            ),
            SpeculativeChoice(method, num_speculative_tokens),
        )
        try:
            handle = engine.submit(request)
            if as_json:
                result = handle.result()
                typer.echo(
                    json.dumps(
                        {
                            "token_ids": list(result.token_ids),
                            "text": result.text,
                            "finish_reason": result.finish_reason,
                            **result.stats.as_dict(),
                        }
                    )
                )
                return
            stats = None
            for delta in handle:
                typer.echo(delta.text, nl=False)
                stats = delta.stats
            typer.echo()
            if stats is not None:
                typer.echo(
                    f"[{stats.method}: {stats.num_output_tokens} tokens, "
                    f"{stats.tokens_per_second:.1f} tok/s, acceptance {stats.acceptance_rate:.2f}, "
                    f"{stats.mean_acceptance_length:.2f} tokens/pass]",
                    err=True,
                )
        except EngineError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    finally:
        engine.close()
