"""The first divergence from plain decoding of every benchmarked output that differs, with
the target's logit gap there (``engine.speculation.divergence``)."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedModel

from bench.report import DivergenceTable, RunTable
from bench.variants import Variant
from bench.workload import BenchPrompt
from engine.speculation.divergence import first_divergence, plain_step_logits


def find_divergences(
    target: PreTrainedModel,
    runs: RunTable,
    prompts: Iterable[BenchPrompt],
    baseline: Variant,
    pass_length: int,
) -> DivergenceTable:
    """Per (workload, prompt, variant): the first divergence of each of its runs whose tokens
    differ from plain decoding's, in the order of the runs."""
    table: DivergenceTable = {}
    for prompt in prompts:
        plain = runs[(prompt.workload, prompt.name, baseline)][0].token_ids
        differing = {
            (variant, run.token_ids)
            for (workload, name, variant), repeats in runs.items()
            if (workload, name) == (prompt.workload, prompt.name)
            for run in repeats
            if run.token_ids != plain
        }
        if not differing or not plain:
            continue
        logits = plain_step_logits(target, prompt.prompt_ids, plain)
        for variant, tokens in sorted(differing, key=lambda item: (item[0].label, item[1])):
            divergence = first_divergence(
                target, prompt.prompt_ids, plain, tokens, pass_length, logits
            )
            if divergence is not None:
                key = (prompt.workload, prompt.name, variant)
                table.setdefault(key, []).append(divergence)
    return table
