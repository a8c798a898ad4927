"""``specgate generate`` end to end through the real command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli import app
from tests.tiny_models import build_model, build_pair, build_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("cli"))


def generate(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(app, ["generate", "--dtype", "float32", "--json", *args])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_generate_json_reports_tokens_text_and_statistics(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    plain = generate("--target", str(target), "--prompt-ids", "5,6,7", "--max-tokens", "12")
    spec = generate(
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--method",
        "draft",
        "--num-speculative-tokens",
        "3",
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "12",
    )
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]
    assert spec["finish_reason"] in ("stop", "length")
    assert spec["method"] == "draft" and spec["num_draft_tokens"] > 0  # type: ignore[operator]
    for key in (
        "acceptance_rate",
        "mean_acceptance_length",
        "num_target_passes",
        "fallback_active",
        "time_to_first_token_s",
        "tokens_per_second",
    ):
        assert key in spec


def test_generate_refuses_two_prompts(pair: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--target", str(pair[0]), "--prompt", "a", "--prompt-ids", "1"]
    )
    assert result.exit_code != 0
    assert "exactly one of --prompt and --prompt-ids" in result.output


def test_heads_for_another_target_are_one_line_exit_2(pair: tuple[Path, Path]) -> None:
    """A heads directory that does not fit the target (here: a model, no heads at all) is the
    loader's own message on one line, exit 2, not a traceback."""
    target, draft = pair
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--target",
            str(target),
            "--heads",
            str(draft),
            "--method",
            "medusa",
            "--prompt-ids",
            "5,6",
            "--dtype",
            "float32",
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.output
    assert "no Medusa heads" in result.output


def test_a_draft_with_another_vocabulary_is_one_line_exit_2(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = pair
    other = build_model(tmp_path / "other", build_tokenizer(vocab_size=200), seed=3, hidden=32)
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(other),
            "--method",
            "draft",
            "--prompt-ids",
            "5,6",
            "--dtype",
            "float32",
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.output
