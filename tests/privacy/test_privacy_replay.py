"""Replay where the outputs really differ: across methods on a target whose verification
passes are perturbed (a test double of a broken verifier), and on a second, different model.

The tiny float32 models give the same greedy tokens under every method, so a cross-method
replay there can only match. Here the served target's multi-token passes have the first row's
least likely token raised above the maximum (far beyond any rounding), as
tests/engine/test_engine_divergence.py does for the engine: speculative greedy output then leaves
plain decoding, and replay must say where and by how wide a logit gap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from engine.speculation.divergence import ROUNDING_ULPS, first_difference
from gateway.app import load_local_backend
from gateway.backends.base import GenerationBackend
from gateway.cli import app as specgate_cli
from gateway.privacy.replay import Recorded, find_recorded, replay
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_model, build_noisy_copy, build_pair, build_tokenizer

MODEL = "target"
PROMPT = "a b c a b c a b c a b"
# Speculation stays on however little is accepted, with a fixed k: adaptive k would learn
# from the perturbed passes to stop proposing, and a later request would meet none.
SPECULATION: dict[str, Any] = {
    "acceptance_threshold": 0.0,
    "fallback_min_speedup": 0.0,
    "num_speculative_tokens": 3,
}


def _perturb_verification(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
    """In every pass of several rows, each sequence's first row gets its least likely token
    raised above its most likely one (a verification that is off by far more than rounding)."""
    logits = output.logits
    if logits.shape[1] > 1:
        for row in logits[:, 0]:
            row[row.argmin()] = row.max() + 1.0
    return output


def _rounding_noise(seed: int) -> Any:
    """A forward hook for a bfloat16 target: passes of several rows round differently from
    one-token steps, every logit moved by up to half ``ROUNDING_ULPS`` ulps at its magnitude
    (a gap between two logits by up to the bound), as real models' passes do and the tiny
    models' bfloat16 passes happen not to (tests/engine/test_engine_divergence.py)."""
    noise = torch.Generator().manual_seed(seed)

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        logits = output.logits
        if logits.shape[1] > 1:
            wide = logits.float()
            magnitude = wide.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
            spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(
                torch.floor(torch.log2(magnitude))
            )
            uniform = torch.rand(wide.shape, generator=noise) * 2.0 - 1.0
            logits.copy_(wide + uniform * spacing * (ROUNDING_ULPS / 2.0))
        return output

    return hook


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("replay-models")
    target, _ = build_pair(root)
    return target, build_noisy_copy(target, root / "close", noise=0.3)


@pytest.fixture(scope="module")
def gateway(
    models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models,
            tmp_path_factory.mktemp("replay-data"),
            url,
            store_content=True,
            **SPECULATION,
        )
        with live_gateway(settings, name) as live:
            hook = live.engine.target_model.register_forward_hook(_perturb_verification)
            try:
                yield live
            finally:
                hook.remove()


def _chat(gateway: LiveGateway, method: str, prompt: str = PROMPT) -> Recorded:
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24,
            "temperature": 0,
            "speculative": {"method": method},
        },
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    event_id = response.headers["x-specgate-audit-id"]
    deadline = time.monotonic() + 10
    while True:
        try:
            return find_recorded(gateway.services.audit, gateway.services.db, event_id)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _tokens(gateway: LiveGateway, recorded: Recorded) -> tuple[list[int], list[int]]:
    """The recorded prompt's and completion's token ids (from the stored content)."""
    privacy = gateway.services.privacy
    prompt = privacy.read_content(recorded.request.payload["content"])["prompt_token_ids"]
    output = privacy.read_content(recorded.completion.payload["content"])
    return prompt, output["choices"][0]["token_ids"]


def _replay(gateway: LiveGateway, event_id: str, method: str) -> dict[str, Any]:
    response = httpx.post(
        f"{gateway.base_url}/v1/audit/replay/{event_id}",
        params={"method": method},
        headers={"authorization": f"Bearer {gateway.keys['auditor']}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


def _plain_gap(target: Path, context: list[int], plain_token: int, other_token: int) -> float:
    """The unperturbed target's logit gap after ``context`` (one fresh forward pass)."""
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([context])).logits[0, -1]
    return float(logits[plain_token] - logits[other_token])


@pytest.mark.parametrize(
    ("recorded_method", "replay_method"), [("ngram", "none"), ("none", "ngram")]
)
def test_a_cross_method_replay_names_the_first_difference_and_its_logit_gap(
    gateway: LiveGateway, models: tuple[Path, Path], recorded_method: str, replay_method: str
) -> None:
    plain_record, speculative_record = _chat(gateway, "none"), _chat(gateway, "ngram")
    prompt, plain = _tokens(gateway, plain_record)
    _, speculative = _tokens(gateway, speculative_record)
    position = first_difference(plain, speculative)
    assert position is not None, "the perturbed verification changed nothing"

    recorded = plain_record if recorded_method == "none" else speculative_record
    report = _replay(gateway, recorded.request.event_id, replay_method)
    assert report["replayed"] is True and report["match"] is False, report
    [choice] = report["choices"]
    assert choice["match"] is False and choice["first_difference"] == position
    # The speculative side, whichever it was, is judged against plain decoding.
    [divergence] = choice["divergences"]
    assert divergence["output"] == ("recorded" if recorded_method == "ngram" else "replayed")
    assert divergence["method"] == "ngram"
    assert divergence["position"] == position
    assert (divergence["plain_token"], divergence["other_token"]) == (
        plain[position],
        speculative[position],
    )
    context = [*prompt, *plain[:position]]
    expected = _plain_gap(models[0], context, plain[position], speculative[position])
    assert divergence["plain_gap"] == pytest.approx(expected, abs=1e-4)
    assert divergence["plain_gap"] > divergence["bound"] > 0
    assert divergence["within_rounding"] is False
    assert divergence["dtype"] == "float32"


def test_when_neither_output_is_plain_both_are_judged_against_a_plain_rerun(
    gateway: LiveGateway,
) -> None:
    _, plain = _tokens(gateway, _chat(gateway, "none"))
    ngram_record, draft_record = _chat(gateway, "ngram"), _chat(gateway, "draft")
    outputs = {"recorded": _tokens(gateway, ngram_record)[1]}
    outputs["replayed"] = _tokens(gateway, draft_record)[1]
    assert all(first_difference(plain, ids) is not None for ids in outputs.values())
    report = _replay(gateway, ngram_record.request.event_id, "draft")
    [choice] = report["choices"]
    assert choice["first_difference"] == first_difference(outputs["recorded"], outputs["replayed"])
    found = {d["output"]: d for d in choice["divergences"]}
    assert set(found) == {"recorded", "replayed"}
    assert (found["recorded"]["method"], found["replayed"]["method"]) == ("ngram", "draft")
    for name, ids in outputs.items():
        position = first_difference(plain, ids)
        assert found[name]["position"] == position
        assert position is not None and found[name]["plain_token"] == plain[position]
        assert found[name]["within_rounding"] is False


def test_the_cli_reports_a_divergence_beyond_rounding(gateway: LiveGateway) -> None:
    recorded = _chat(gateway, "ngram")
    result = CliRunner().invoke(
        specgate_cli,
        [
            *("audit", "replay", recorded.request.event_id, "--method", "none"),
            *("--url", gateway.base_url, "--key", gateway.keys["auditor"]),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "leaves plain decoding at token" in result.output
    assert "BEYOND the dtype's rounding" in result.output and "MISMATCH" in result.output


@pytest.fixture(scope="module")
def second_backend(
    models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GenerationBackend]:
    """The same draft beside another target: same tokenizer and name, other weights."""
    root = tmp_path_factory.mktemp("second-model")
    other = build_model(root / MODEL, build_tokenizer(), seed=5, hidden=64, layers=2)
    settings = gateway_settings((other, models[1]), root / "data", "sqlite://", **SPECULATION)
    backend = load_local_backend(settings, lambda _event: None)
    yield backend
    backend.close()


def test_replay_on_a_second_model_names_the_version_and_claims_no_match(
    gateway: LiveGateway, second_backend: GenerationBackend
) -> None:
    recorded = _chat(gateway, "none")
    loaded, card = gateway.services.backend.card, second_backend.card
    assert card.model_name == loaded.model_name and card.target_version != loaded.target_version
    assert card.artefacts == loaded.artefacts
    report = asyncio.run(replay(second_backend, gateway.services.privacy, recorded))
    assert report["replayed"] is False and report["match"] is False
    assert report["differences"] == [
        f"target_version: recorded {loaded.target_version!r}, loaded {card.target_version!r}"
    ]
    assert report["choices"] == []


@pytest.fixture(scope="module")
def bf16_gateway(
    models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models, tmp_path_factory.mktemp("bf16-data"), url, store_content=True, **SPECULATION
        ).model_copy(update={"dtype": "bfloat16"})
        with live_gateway(settings, name) as live:
            assert live.engine.target_model.dtype == torch.bfloat16
            hook = live.engine.target_model.register_forward_hook(_rounding_noise(3))
            try:
                yield live
            finally:
                hook.remove()


def test_a_cross_method_replay_in_bfloat16_finds_near_ties_within_rounding(
    bf16_gateway: LiveGateway,
) -> None:
    """Speculative greedy output that leaves plain decoding only where the target's top two
    logits are closer than bfloat16's rounding: replay says so (``within_rounding``)."""
    found = []
    for index in range(24):
        words = " ".join(f"w{(index * 7 + n) % 13}" for n in range(3))
        prompt = " ".join([words] * 4)
        recorded = _chat(bf16_gateway, "ngram", prompt)
        report = _replay(bf16_gateway, recorded.request.event_id, "none")
        assert report["replayed"] is True, report
        [choice] = report["choices"]
        if choice["match"]:
            continue
        [divergence] = choice["divergences"]
        assert (
            divergence["output"] == "recorded"
            and divergence["position"] == (choice["first_difference"])
        )
        found.append(divergence)
        if len(found) == 2:
            break
    assert found, "no divergence in 24 prompts: the test would exercise nothing"
    for divergence in found:
        assert divergence["dtype"] == "bfloat16"
        assert 0.0 <= divergence["plain_gap"] <= divergence["bound"], divergence
        assert divergence["within_rounding"] is True
