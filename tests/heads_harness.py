"""What the Medusa and the EAGLE tests share: engines over heads trained in the test, under a
clock-free cost model, and their greedy and sampled runs against the target alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.adaptive import PassCosts
from engine.speculation.batch_speculation import StepCosts
from engine.speculation.proposers.base import Proposal
from engine.speculation.sampling import TreeVerdict, verify_tree_greedy
from engine.speculation.tree import children
from tests.engine.test_engine_sampling import (
    SIGNIFICANCE,
    chi_square_p_value,
    draw,
    exact_pair_distribution,
)
from tests.tiny_models import SAMPLE_TEXT

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n", "class Point:\n    def"]
# What every pass costs under ``clock_free_costs``, whatever its width.
FLAT_PASS_SECONDS = 1e-3

_record_target = PassCosts.record_target
_record_proposer = PassCosts.record_proposer
_record_proposal = PassCosts.record_proposal
_record_tree_level = PassCosts.record_tree_level
_record_step = StepCosts.record


def quiet(*_args: object) -> None:
    return None


@contextmanager
def clock_free_costs() -> Iterator[None]:
    """While open, every target pass and batched step is recorded as costing the same,
    whatever its width, and a proposal (and an EAGLE tree level) as costing nothing (an
    accelerator's costs), so an engine's adaptive k and tree depth follow the heads'
    acceptance alone and a run is the same on any machine under any load.

    With the clock's figures the adaptive runs were a matter of timing: on a loaded machine a
    pass descheduled for 30 to 300 times its cost makes speculating look dear, most steps run
    plain and the few one-token probes can all miss, so that the heads "never got a token
    accepted" (test_greedy_medusa_equals_plain_decoding[None], once in CI; 2 runs in 30 of its
    body under such noise, none with these costs). Everything else the tests run, the tiny
    models, their tokenizer and the heads' training included, is bit-identical at 1 to 4
    threads."""

    def target(costs: PassCosts, tokens: int, _seconds: float) -> None:
        _record_target(costs, tokens, FLAT_PASS_SECONDS)

    def proposer(costs: PassCosts, method: str, _seconds: float) -> None:
        _record_proposer(costs, method, 0.0)

    def proposal(costs: PassCosts, method: str, _seconds: float) -> None:
        _record_proposal(costs, method, 0.0)

    def tree_level(costs: PassCosts, method: str, _seconds: float) -> None:
        _record_tree_level(costs, method, 0.0)

    def step(steps: StepCosts, batch: int, width: int, _seconds: float) -> None:
        _record_step(steps, batch, width, FLAT_PASS_SECONDS)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PassCosts, "record_target", target)
        patch.setattr(PassCosts, "record_proposer", proposer)
        patch.setattr(PassCosts, "record_proposal", proposal)
        patch.setattr(PassCosts, "record_tree_level", tree_level)
        patch.setattr(StepCosts, "record", step)
        yield


@contextmanager
def heads_engine(
    target: Path, heads: Path, method: str, options: dict[str, Any] | None = None
) -> Iterator[Engine]:
    """An engine speculating with ``method``'s heads (never switched off, whatever the
    acceptance), loaded and served under ``clock_free_costs``."""
    speculative = {"method": method, "acceptance_threshold": 0.0, "min_speedup": 0.0}
    config = EngineConfig(
        target=target, heads=heads, dtype="float32",
        speculative=SpeculativeConfig.model_validate({**speculative, **(options or {})}),
    )
    with clock_free_costs():
        engine = Engine.load(config)
        try:
            yield engine
        finally:
            engine.close()


def greedy_equals_plain(engine: Engine, method: str, k: int | None) -> int:
    """Greedy speculation with ``method`` (``k`` None: adaptive) on every prompt gives plain
    decoding's tokens exactly, each run proposing something; returns the tokens accepted."""
    accepted = 0
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for text in PROMPTS:
        prompt = tuple(engine.tokenizer.encode(text))
        plain = engine.generate(GenerationRequest(prompt, params, SpeculativeChoice("none")))
        choice = SpeculativeChoice(method, k)  # type: ignore[arg-type]
        speculated = engine.generate(GenerationRequest(prompt, params, choice))
        assert speculated.token_ids == plain.token_ids
        assert speculated.stats.num_drafts > 0
        accepted += speculated.stats.num_accepted_tokens
    return accepted


def side_branch_recorder(branches: list[bool]) -> Callable[[Proposal, torch.Tensor], TreeVerdict]:
    """``verify_tree_greedy``, noting for each verdict whether its accepted path left the
    chain of first children (a real tree branch)."""

    def recording(proposal: Proposal, logits: torch.Tensor) -> TreeVerdict:
        verdict = verify_tree_greedy(proposal, logits)
        firsts = {kids[0] for kids in children(proposal.parent_indices()) if kids}
        branches.append(any(node not in firsts for node in verdict.path))
        return verdict

    return recording


def record_proposed_tokens(monkeypatch: pytest.MonkeyPatch, proposer: type) -> list[int]:
    """Every token ``proposer``'s instances propose from now on, in order."""
    proposed: list[int] = []
    propose = proposer.propose

    def recording(self: object, *args: Any, **kwargs: Any) -> Proposal:
        proposal: Proposal = propose(self, *args, **kwargs)
        proposed.extend(proposal.tokens)
        return proposal

    monkeypatch.setattr(proposer, "propose", recording)
    return proposed


def assert_sampling_is_exact(engine: Engine, method: str) -> None:
    """Sampled speculation with ``method`` draws the first two tokens from the target's exact
    distribution: chi-square at SIGNIFICANCE (0.001) over SAMPLES seeded draws."""
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    counts = draw(engine, prompt, params, method)
    assert chi_square_p_value(counts, exact_pair_distribution(engine, prompt, params)) > (
        SIGNIFICANCE
    )


def train_heads_with_cli(target: Path, tmp_path: Path, method: str, *options: str) -> Path:
    """``specgate heads train --method METHOD`` on ``target`` over the sample text as a data
    directory, with ``options``; the heads' directory (the command must succeed)."""
    from typer.testing import CliRunner

    from gateway.cli import app

    data = tmp_path / "data"
    data.mkdir()
    (data / "code.txt").write_text("".join(SAMPLE_TEXT))
    out = tmp_path / "cli-heads"
    result = CliRunner().invoke(
        app,
        ["heads", "train", "--method", method, "--target", str(target), "--out", str(out),
         "--data", str(data), *options],
    )
    assert result.exit_code == 0, result.output
    return out
