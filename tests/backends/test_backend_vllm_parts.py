"""The vLLM backend's parts that need no server: settings, egress, manifest, wire parsing,
interval attribution and replica routing. The backend itself is tested against real vLLM
servers in test_backend_vllm.py (the tokenizer check here stands a tokenizer in for the
server's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from engine.models.versioning import MANIFEST_NAME, model_version, read_manifest, write_manifest
from gateway.backends.vllm import served_artefacts, specgate_method
from gateway.backends.vllm_acceptance import IntervalAttribution, split
from gateway.backends.vllm_replicas import Replica, Replicas
from gateway.backends.vllm_tokenizer import PROBE_TEXT, LocalTokenizer, disagreement
from gateway.backends.vllm_wire import WireError, parse_event, spec_counters, token_logprobs
from gateway.cli import app as cli
from gateway.observability.egress import EgressRefusedError
from gateway.observability.telemetry import check_egress
from gateway.settings import ConfigError, Settings, load_settings, vllm_backend_from_flags
from tests.tiny_models import build_tokenizer

VERSION = "sha256:" + "cd" * 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def vllm_block(*urls: str) -> dict[str, object]:
    return {"kind": "vllm", "vllm_servers": [{"url": u, "model_version": VERSION} for u in urls]}


# --- settings ------------------------------------------------------------------------------


def test_backend_block_from_yaml_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "backend:\n  kind: vllm\n  vllm_servers:\n"
        "    - url: http://vllm.llm.svc:8000\n      model_version: " + VERSION + "\n"
        "    - url: http://vllm-ngram.llm.svc:8000\n      model_version: " + VERSION + "\n"
        "      speculative_config: {method: ngram, num_speculative_tokens: 3}\n"
    )
    loaded = load_settings(config)
    assert [s.resolved_pool for s in loaded.backend.vllm_servers] == ["plain", "speculative"]
    monkeypatch.setenv("SPECGATE_BACKEND", json.dumps(vllm_block("http://10.0.0.5:8000")))
    from_env = load_settings(config)  # the variable wins over the file
    assert [s.url for s in from_env.backend.vllm_servers] == ["http://10.0.0.5:8000"]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"kind": "vllm"}, "at least one"),
        ({"kind": "vllm", "vllm_servers": [{"url": "http://a.svc:8000"}]}, "model_version"),
        (
            {
                "kind": "vllm",
                "vllm_servers": [
                    {"url": "http://a.svc:8000", "model_version": VERSION, "pool": "speculative"}
                ],
            },
            "speculative_config",
        ),
        ({"kind": "vllm", "vllm_servers": [{"url": "http://a", "versio": 1}]}, "versio"),
    ],
)
def test_an_unusable_backend_block_is_refused_naming_the_field(
    block: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_settings(None, backend=block)
    assert "backend" in str(error.value)


def test_serve_flags_make_the_pools() -> None:
    block = vllm_backend_from_flags(
        None,
        plain_urls=["http://a.svc:8000"],
        speculative_urls=["http://b.svc:8000", "http://c.svc:8000"],
        speculative_config=json.dumps(NGRAM),
        model_version=VERSION,
        model_dir=None,
    )
    settings = load_settings(None, backend=block)
    servers = settings.backend.vllm_servers
    assert [(s.url, s.resolved_pool, s.speculative_config) for s in servers] == [
        ("http://a.svc:8000", "plain", None),
        ("http://b.svc:8000", "speculative", NGRAM),
        ("http://c.svc:8000", "speculative", NGRAM),
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="--vllm-speculative-config"):
        vllm_backend_from_flags(
            "vllm", plain_urls=[], speculative_urls=["http://b.svc:8000"],
            speculative_config=None, model_version=VERSION, model_dir=None,
        )  # fmt: skip


def test_serve_refuses_vllm_without_servers(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["serve", "--backend", "vllm", "--database-url", f"sqlite:///{tmp_path}/a.db"]
    )
    assert result.exit_code == 2
    assert "--backend vllm needs" in result.output


def test_the_egress_guard_covers_vllm_urls() -> None:
    inside = Settings(backend=vllm_block("http://vllm.llm.svc:8000", "http://10.1.2.3:8000"))
    allowed = check_egress(inside, {})
    assert [a.source for a in allowed] == [
        "backend.vllm_servers[0].url",
        "backend.vllm_servers[1].url",
    ]
    outside = Settings(backend=vllm_block("http://vllm.llm.svc:8000", "https://api.example.com"))
    with pytest.raises(EgressRefusedError, match=r"backend.vllm_servers\[1\].url"):
        check_egress(outside, {})


# --- manifest ------------------------------------------------------------------------------


def test_models_hash_writes_the_version_the_engine_records(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    before = model_version(model)
    result = CliRunner().invoke(cli, ["models", "hash", str(model)])
    assert result.exit_code == 0, result.output
    assert (model / MANIFEST_NAME).is_file()
    assert read_manifest(model) == before == model_version(model)  # not part of its own hash
    (model / "model.safetensors").write_bytes(b"other weights")
    write_manifest(model)
    assert read_manifest(model) != before


def test_a_missing_manifest_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="specgate models hash"):
        read_manifest(tmp_path)


def test_a_draft_model_server_records_the_drafts_version(tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"vocab_size": 320}')
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=f"specgate models hash {draft}"):
        served_artefacts(config)  # an unversioned draft: the gateway refuses to start
    write_manifest(draft)
    assert served_artefacts(config) == (
        {"kind": "draft_model", "name": "draft", "version": model_version(draft)},
    )
    assert specgate_method(config) == "draft"
    assert served_artefacts(NGRAM) == () and specgate_method(NGRAM) == "ngram"


# --- wire ----------------------------------------------------------------------------------


def test_stream_pieces_and_per_request_figures() -> None:
    piece = parse_event(
        'data: {"choices":[{"index":0,"text":"ab","token_ids":[5,6],"finish_reason":null}]}'
    )
    assert piece is not None and (piece.text, piece.token_ids) == ("ab", (5, 6))
    final = parse_event(
        'data: {"choices":[],"usage":{"completion_tokens":2},"metrics":{"speculative_decoding":'
        '{"num_spec_steps":1,"num_draft_tokens":3,"num_accepted_draft_tokens":1}}}'
    )
    assert final is not None and final.speculative == {
        "num_spec_steps": 1, "num_draft_tokens": 3, "num_accepted_draft_tokens": 1,
    }  # fmt: skip
    assert parse_event("data: [DONE]") is None
    with pytest.raises(WireError):
        parse_event('data: {"error": {"message": "boom"}}')


def test_logprobs_keep_the_asked_number_of_most_likely_alternatives() -> None:
    # vLLM's map holds the chosen token too when it is not among the top ones (" b" here).
    wire = {
        "tokens": ["é", " b"],
        "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"é": -0.1, "x": -2.5}, {" b": -3.0, "a": -0.2, "c": -1.0}],
    }
    first, second = token_logprobs(wire, (7, 9), 2)
    assert (first.token_id, first.text, first.bytes, first.logprob) == (7, "é", (195, 169), -0.1)
    assert first.top == (("é", (195, 169), -0.1), ("x", (120,), -2.5))
    assert second.top == (("a", (97,), -0.2), ("c", (99,), -1.0))
    assert [e.top for e in token_logprobs(wire, (7, 9), 0)] == [(), ()]
    piece = parse_event(
        'data: {"choices":[{"text":"é b","token_ids":[7,9],"logprobs":' + json.dumps(wire) + "}]}",
        top_logprobs=1,
    )
    assert piece is not None and piece.logprobs is not None
    assert [e.top for e in piece.logprobs] == [(first.top[0],), (second.top[0],)]
    with pytest.raises(WireError, match="2 tokens in a chunk of 3"):
        token_logprobs(wire, (7, 9, 11), 2)
    with pytest.raises(WireError, match="has none"):
        token_logprobs(None, (7,), 2)


def test_prometheus_counters_are_read_by_name() -> None:
    exposition = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 9.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0',
        ]
    )
    assert spec_counters(exposition) == {
        "vllm:spec_decode_num_drafts": 3.0,
        "vllm:spec_decode_num_draft_tokens": 9.0,
        "vllm:spec_decode_num_accepted_tokens": 4.0,
    }


# --- interval attribution ------------------------------------------------------------------


@given(st.integers(0, 10_000), st.lists(st.integers(0, 500), min_size=1, max_size=20))
def test_split_shares_add_up_and_follow_the_weights(total: int, weights: list[int]) -> None:
    shares = split(total, weights)
    assert sum(shares) == total and all(s >= 0 for s in shares)
    if sum(weights):
        for share, weight in zip(shares, weights, strict=True):
            assert abs(share - total * weight / sum(weights)) < 1 + 1e-9


def test_an_interval_increase_goes_to_that_interval_requests() -> None:
    async def run() -> list[tuple[int, int, int]]:
        attribution = IntervalAttribution()
        attribution.settle({"vllm:spec_decode_num_draft_tokens": 100.0})  # the baseline
        first, second = attribution.wait(30), attribution.wait(10)
        attribution.settle(
            {
                "vllm:spec_decode_num_drafts": 8.0,
                "vllm:spec_decode_num_draft_tokens": 124.0,
                "vllm:spec_decode_num_accepted_tokens": 12.0,
            }
        )
        later = attribution.wait(5)
        attribution.settle(None)  # a failed scrape: zeros, not a guess
        return [
            (f.num_drafts, f.num_draft_tokens, f.num_accepted_tokens)
            for f in (await first, await second, await later)
        ]

    assert asyncio.run(run()) == [(6, 18, 9), (2, 6, 3), (0, 0, 0)]


# --- routing -------------------------------------------------------------------------------


def test_least_outstanding_requests_and_healthy_replicas_only() -> None:
    a, b, c = (Replica(f"http://{n}.svc", "plain", None) for n in "abc")
    spec = Replica("http://s.svc", "speculative", NGRAM)
    replicas = Replicas([a, b, c, spec])
    a.outstanding, b.outstanding, c.outstanding = 2, 1, 1
    assert {replicas.pick("plain").url for _ in range(4)} == {b.url, c.url}  # type: ignore[union-attr]
    event = b.take_out("health check failed")
    assert event is not None and event.action == "removed"
    assert b.take_out("again") is None  # one event per change
    assert replicas.pick("plain") is c
    assert replicas.pick("plain", exclude=[c]) is a
    assert replicas.pick("speculative") is spec
    c.take_out("down")
    a.take_out("down")
    assert replicas.pick("plain") is None
    restored = b.put_back()
    assert restored is not None and restored.action == "restored"
    assert replicas.pick("plain") is b


def saved_tokenizer(folder: Path, drop_merges: bool = False) -> LocalTokenizer:
    build_tokenizer().save_pretrained(folder)
    if drop_merges:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["model"]["merges"] = []
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    local = LocalTokenizer.load(folder)
    assert local is not None
    return local


def test_the_local_tokenizer_is_used_only_where_it_answers_as_the_server(tmp_path: Path) -> None:
    """The probe: the same files agree; a tokenizer encoding otherwise is named as such; one
    that decodes otherwise (here: the server's decode drops special tokens) too."""
    server = saved_tokenizer(tmp_path / "server")
    same = saved_tokenizer(tmp_path / "same")
    assert disagreement(same, server.encode, server.decode) is None
    other = saved_tokenizer(tmp_path / "other", drop_merges=True)
    assert other.encode(PROBE_TEXT) != server.encode(PROBE_TEXT)
    assert disagreement(other, server.encode, server.decode) == "the probe text's token ids differ"
    special = set(server.special_ids)
    assert special

    def without_special(ids: Sequence[int]) -> str:
        return server.decode([i for i in ids if i not in special])

    assert disagreement(same, server.encode, without_special) == "the probe ids' text differs"


def test_a_folder_without_a_tokenizer_gives_none(tmp_path: Path) -> None:
    assert LocalTokenizer.load(tmp_path) is None
