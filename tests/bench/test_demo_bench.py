"""The benchmark: its arithmetic on known runs, and one real run on tiny models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer import Typer
from typer.testing import CliRunner

from bench.cli import bench
from bench.costs import PassCosts
from bench.report import (
    DivergenceTable,
    RunTable,
    markdown,
    recommend,
    summarise,
)
from bench.variants import Run, Variant
from engine.api.types import GenerationStats, Method
from engine.models.loading import load_model, load_tokenizer
from engine.models.versioning import model_version
from engine.speculation.adaptive import expected_tokens, pass_cost_speedup
from engine.speculation.adaptive import theoretical_speedup as textbook_speedup
from engine.speculation.divergence import Divergence, rounding_bound
from engine.training.heads.loading import load_heads_for
from engine.training.heads.train import HeadsSpec, build_data, train_eagle, train_medusa
from tests.tiny_models import SAMPLE_TEXT, build_pair

NONE = Variant("specgate", "none", None)
NGRAM = Variant("specgate", "ngram", 4)
DRAFT = Variant("specgate", "draft", None)
HF_PLAIN = Variant("hf", "none", None)
COSTS = PassCosts(context_tokens=8, target_one_ms=10.0, target_verify_ms=11.0, verify_tokens=5,
                  draft_one_ms=1.0)


@given(st.floats(0.0, 0.99), st.integers(1, 16), st.floats(0.0, 1.0), st.integers(1, 50))
def test_pass_cost_speedup_is_the_textbook_formula_for_independent_acceptance(
    alpha: float, k: int, c: float, passes: int
) -> None:
    # Passes that all propose k, at the tokens per pass one rate at every position expects,
    # with a verifying pass costing a plain one: (1 - a^(k+1)) / ((1 - a)(k c + 1)).
    accepted = (expected_tokens(alpha, k) - 1.0) * passes
    speedup = pass_cost_speedup(k * passes, accepted, passes, passes, 1.0, c, 1.0)
    assert speedup == pytest.approx(textbook_speedup(alpha, k, c))


def _stats(method: Method, drafts: int, drafted: int, accepted: int) -> GenerationStats:
    return GenerationStats(
        method=method,
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
    )


def _table() -> RunTable:
    plain = (1, 2, 3, 4)
    return {
        ("code", "p1", NONE): [Run(plain, 4.0, _stats("none", 0, 0, 0)),
                               Run(plain, 2.0, _stats("none", 0, 0, 0)),
                               Run(plain, 3.0, _stats("none", 0, 0, 0))],
        ("code", "p1", NGRAM): [Run(plain, 1.5, _stats("ngram", 2, 8, 4))] * 3,
        ("code", "p1", DRAFT): [Run(plain, 1.0, _stats("draft", 2, 6, 6))] * 3,
        ("code", "p1", HF_PLAIN): [Run((1, 2, 3, 9), 3.0, None)] * 3,
    }


def test_summary_uses_medians_and_pooled_acceptance() -> None:
    rows = {r.variant: r for r in summarise(_table(), [NONE, NGRAM, DRAFT, HF_PLAIN], COSTS)}
    assert [r.workload for r in rows.values()] == ["code"] * 4
    assert rows[NONE].speedup == 1.0
    assert rows[NONE].tokens_per_second == pytest.approx(4 / 3.0)
    assert rows[NGRAM].speedup == pytest.approx(2.0)
    assert rows[NGRAM].acceptance_rate == pytest.approx(0.5)
    assert rows[NGRAM].mean_acceptance_length == pytest.approx(3.0)
    # Theoretical: the measured tokens per pass over each pass's measured cost in one-token
    # passes (COSTS: 5 rows cost 1.1, so 4 proposed 1.1 and 3 proposed 1.075; c = 0.1).
    assert rows[NGRAM].theoretical == pytest.approx(3.0 / 1.1)
    assert rows[DRAFT].theoretical == pytest.approx(4.0 / (1.075 + 3 * 0.1))
    assert rows[DRAFT].of_theoretical == pytest.approx(3.0 / (4.0 / 1.375))
    assert rows[HF_PLAIN].theoretical is None
    assert not rows[HF_PLAIN].same_tokens_as_plain
    assert rows[DRAFT].same_tokens_as_plain


def test_theoretical_speedup_is_measured_acceptance_over_measured_pass_costs() -> None:
    # Acceptance in runs: two steps of 4 proposals, one accepting all 4 and one none. One
    # rate at every position (a = 0.5) would predict 1.94 tokens per pass; they gave 3.
    plain = (1, 2, 3, 4)
    table: RunTable = {
        ("code", "p1", NONE): [Run(plain, 3.0, _stats("none", 0, 0, 0))],
        ("code", "p1", NGRAM): [Run(plain, 1.5, _stats("ngram", 2, 8, 4))],
    }
    rows = {r.variant: r for r in summarise(table, [NONE, NGRAM], COSTS)}
    assert rows[NGRAM].theoretical == pytest.approx(3.0 / 1.1)


def test_theoretical_speedup_counts_the_plain_passes_adaptive_k_chose() -> None:
    # 2 passes verified 4 proposals each (3 accepted in all), 2 more ran plain: 7 tokens
    # for 2 * (1.1 + 4 * 0.1) + 2 one-token passes.
    plain = (1, 2, 3, 4)
    stats = _stats("draft", 2, 8, 3)
    stats.num_target_passes = 4
    table: RunTable = {
        ("code", "p1", NONE): [Run(plain, 3.0, _stats("none", 0, 0, 0))],
        ("code", "p1", DRAFT): [Run(plain, 1.5, stats)],
    }
    rows = {r.variant: r for r in summarise(table, [NONE, DRAFT], COSTS)}
    assert rows[DRAFT].theoretical == pytest.approx(7.0 / (2 * (1.1 + 0.4) + 2))


def test_theoretical_speedup_charges_a_heads_method_its_measured_proposals() -> None:
    # EAGLE's draft passes per tree level are proposer time: 2 proposals of 4 tokens, each
    # measured at 5 ms (half a one-token pass), 4 tokens accepted: 6 tokens for
    # 2 * (1.1 + 0.5) passes' time, not 2 * 1.1.
    eagle = Variant("specgate", "eagle", 4)
    plain = (1, 2, 3, 4)
    costs = dataclasses.replace(COSTS, proposal_ms={"eagle": 5.0})
    table: RunTable = {
        ("code", "p1", NONE): [Run(plain, 3.0, _stats("none", 0, 0, 0))],
        ("code", "p1", eagle): [Run(plain, 1.5, _stats("eagle", 2, 8, 4))],
    }
    rows = {r.variant: r for r in summarise(table, [NONE, eagle], costs)}
    assert rows[eagle].theoretical == pytest.approx(6.0 / (2 * (1.1 + 0.5)))
    assert costs.proposer_ratio("ngram", 4.0) == 0.0
    assert costs.proposer_ratio("draft", 4.0) == pytest.approx(0.1)


def test_recommendation_names_the_fastest_lossless_method() -> None:
    rows = summarise(_table(), [NONE, NGRAM, DRAFT, HF_PLAIN], COSTS)
    text = recommend(rows, "code")
    assert text.startswith("code: use `--method draft` with adaptive K")
    assert "expected speedup 3.00x" in text
    slow = {key: [Run(r.token_ids, 3.0, r.stats) for r in runs] for key, runs in _table().items()}
    assert "keep plain decoding" in recommend(summarise(slow, [NONE, NGRAM, DRAFT], COSTS), "code")


# Heads trained a few steps on the tiny target: enough to load and propose.
HEADS_SPEC = HeadsSpec(
    num_heads=2, snippets=8, prompt_tokens=8, answer_tokens=12, generation_batch=8, steps=4,
    rows_per_step=32, draft_vocab_size=64,
)


def _quiet(*_args: object) -> None:
    return None


def _heads(target: Path, out: Path) -> tuple[Path, Path]:
    model = load_model(target, torch.device("cpu"), "float32")
    version = model_version(target)
    data = build_data(model, load_tokenizer(target), SAMPLE_TEXT, HEADS_SPEC, version, _quiet)
    medusa, _ = train_medusa(model, data, HEADS_SPEC, version, _quiet)
    eagle, _ = train_eagle(model, data, HEADS_SPEC, version, target.name, _quiet)
    medusa.save(out / "medusa")
    eagle.save(out / "eagle")
    return out / "medusa", out / "eagle"


def test_bench_command_runs_every_method_on_tiny_models(tmp_path: Path) -> None:
    target, draft = build_pair(tmp_path / "models")
    medusa, eagle = _heads(target, tmp_path / "heads")
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "for i in range(10):"}]}) + "\n"
    )
    out = tmp_path / "out"
    app = Typer()
    app.command()(bench)
    result = CliRunner().invoke(app, [
        "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
        "--out", str(out), "--max-tokens", "12", "--repeats", "1", "--k", "3",
        "--heads", str(medusa), "--heads", str(eagle),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    labels = [row["variant"] for row in report["rows"]]
    assert labels == [
        "none", "ngram k=auto", "ngram k=3", "draft k=auto", "draft k=3",
        "medusa k=auto", "medusa k=3", "eagle k=auto", "eagle k=3",
        "HF plain", "HF prompt lookup", "HF assisted",
    ]
    memory = {row["variant"]: row["extra_memory_share_of_target"] for row in report["rows"]}
    assert memory["none"] is None and memory["HF assisted"] is None
    assert memory["ngram k=3"] == 0.0
    model = load_model(target, torch.device("cpu"), "auto")
    target_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    draft_model = load_model(draft, torch.device("cpu"), "auto")
    draft_bytes = sum(p.numel() * p.element_size() for p in draft_model.parameters())
    assert memory["draft k=3"] == pytest.approx(draft_bytes / target_bytes, abs=1e-4)
    for method, directory in (("medusa", medusa), ("eagle", eagle)):
        _, heads = load_heads_for(directory, model, model_version(target))
        own = sum(p.numel() * p.element_size() for p in heads.parameters())
        rows = 64 * model.config.hidden_size * model.dtype.itemsize + 64 * 8  # subset + ids
        assert memory[f"{method} k=auto"] == pytest.approx((own + rows) / target_bytes, abs=1e-4)
    assert "| extra memory |" in (out / "bench.md").read_text()
    # The heads' proposals are timed, so their theoretical speedup charges them.
    assert set(report["pass_costs"]["proposal_ms"]) == {"medusa", "eagle"}
    assert all(ms > 0 for ms in report["pass_costs"]["proposal_ms"].values())
    assert {row["workload"] for row in report["rows"]} == {"mine"}
    assert all(row["same_tokens_as_plain"] for row in report["rows"])
    assert all(row["tokens"] == 24 for row in report["rows"])
    assert len(report["runs"]) == 2 * len(labels)
    assert report["recommendations"]["mine"].startswith("mine: ")
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "| mine | draft k=3 |" in (out / "bench.md").read_text()
    for label in ("none", "ngram k=3", "draft k=3"):
        assert f"constrained decoding (json_object), {label}: " in (out / "bench.md").read_text()


def _diverging_table() -> RunTable:
    table = _table()
    table[("code", "p1", NGRAM)] = [Run((1, 2, 7, 4), 1.5, _stats("ngram", 2, 8, 4))] * 3
    table[("code", "p1", DRAFT)] = [Run((1, 8, 3, 4), 1.0, _stats("draft", 2, 6, 6))] * 3
    return table


def _divergence(position: int, plain_gap: float) -> Divergence:
    # bfloat16 logits near 10: one ulp is 2^-4, the bound ROUNDING_ULPS of them.
    return Divergence(position, 3, 7, plain_gap, -plain_gap, rounding_bound(10.0, torch.bfloat16),
                      "bfloat16")


def test_a_divergence_within_rounding_is_lossless_in_the_dtype() -> None:
    divergences: DivergenceTable = {
        ("code", "p1", NGRAM): [_divergence(2, 0.0625)],
        ("code", "p1", DRAFT): [_divergence(1, 0.125)],
    }
    rows = {r.variant: r for r in summarise(
        _diverging_table(), [NONE, NGRAM, DRAFT], COSTS, divergences)}
    assert not rows[DRAFT].same_tokens_as_plain
    assert rows[DRAFT].within_rounding is True
    assert rows[DRAFT].first_divergence == 1
    assert rows[NONE].within_rounding is None
    text = recommend(list(rows.values()), "code")
    assert text.startswith("code: use `--method draft`")
    assert "lossless in bfloat16" in text
    assert "--dtype float32" in text
    assert "BUG" not in text


def test_a_divergence_beyond_rounding_is_flagged_as_a_bug() -> None:
    bound = rounding_bound(10.0, torch.bfloat16)
    divergences: DivergenceTable = {
        ("code", "p1", NGRAM): [_divergence(2, 0.0625)],
        ("code", "p1", DRAFT): [_divergence(1, bound * 1.5)],
    }
    rows = summarise(_diverging_table(), [NONE, NGRAM, DRAFT], COSTS, divergences)
    text = recommend(rows, "code")
    assert text.startswith("**BUG: `draft k=auto` is not lossless**")
    assert "use `--method ngram`" in text  # the draft is not recommended, the n-gram row is
    table = markdown(rows, {})
    assert "| code | draft k=auto |" in table
    assert "**NO: bug**" in table


def test_find_divergences_locates_each_differing_run(tmp_path: Path) -> None:
    from bench.divergences import find_divergences
    from bench.workload import BenchPrompt
    from engine.models.loading import load_model
    from engine.speculation.divergence import plain_step_logits

    target, _ = build_pair(tmp_path / "models")
    model = load_model(target, torch.device("cpu"), "bfloat16")
    prompt = BenchPrompt("code", "p1", (5, 9, 13, 5, 9), 6)
    # Plain decoding's greedy tokens, then a run that takes the least likely token at 2.
    plain: list[int] = []
    for _ in range(6):  # the last row is the logits before the placeholder 0
        plain.append(int(plain_step_logits(model, prompt.prompt_ids, [*plain, 0])[-1].argmax()))
    worst = int(plain_step_logits(model, prompt.prompt_ids, plain)[2].argmin())
    other = (*plain[:2], worst, *plain[3:])
    runs: RunTable = {
        ("code", "p1", NONE): [Run(tuple(plain), 1.0, None)],
        ("code", "p1", NGRAM): [Run(other, 1.0, None)] * 2,
        ("code", "p1", DRAFT): [Run(tuple(plain), 1.0, None)],
    }
    table = find_divergences(model, runs, [prompt], NONE, 5)
    assert list(table) == [("code", "p1", NGRAM)]
    (divergence,) = table[("code", "p1", NGRAM)]  # identical runs are judged once
    assert (divergence.position, divergence.plain_token, divergence.other_token) == (
        2, plain[2], worst
    )
    assert not divergence.within_rounding


def test_a_shorter_answer_is_not_a_faster_one() -> None:
    """The speedup is tokens per second over plain decoding's: a near-tie that ends an answer
    after half the tokens in half the time is 1x, not 2x."""
    plain, short = (1, 2, 3, 4), (1, 2)
    table: RunTable = {
        ("code", "p1", NONE): [Run(plain, 4.0, _stats("none", 0, 0, 0))],
        ("code", "p1", NGRAM): [Run(short, 2.0, _stats("ngram", 1, 4, 0))],
    }
    rows = {r.variant: r for r in summarise(table, [NONE, NGRAM], COSTS)}
    assert rows[NGRAM].speedup == pytest.approx(1.0)
