"""Measure a vLLM-served model on its servers: each request replayed on each of its pools
directly (the plain pool and one per speculative configuration), over HTTP to the configured
server URLs, in the benchmark's rotating order (``bench.runner.interleaved_runs``).

A request goes to a pool as the vLLM backend sends it (``gateway.backends.vllm_wire``): a
streamed ``/v1/completions`` with the recorded prompt token ids, so every pool sees the same
input, and its recorded sampling with the token budget capped. The acceptance figures are
vLLM's own for the request (``--per-request-spec-decode-metrics``), else the increase of the
server's ``vllm:spec_decode_*`` counters over the request (the replay sends one request at a
time, so that increase is the request's unless other traffic reaches the server meanwhile).
A running server's k cannot be varied: each pool is measured as it is configured.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from bench.variants import Run, Variant
from engine.api.types import (
    GenerationRequest,
    GenerationStats,
    Method,
    SamplingParams,
    SpeculativeChoice,
)
from gateway.backends.vllm_acceptance import SpecFigures, counter_increase, request_figures
from gateway.backends.vllm_wire import WireError, completion_body, parse_event, spec_counters
from gateway.settings import Settings
from gateway.tune.measure import (
    ModelRun,
    PoolVariant,
    VllmModel,
    VllmPool,
    pool_variants,
    replayable,
)
from gateway.tune.sample import TuneRequest

# The dtype a report names for a vLLM-served model: the servers', not known here.
AS_SERVED = "as served"
# The context a server is taken to have when /v1/models gives no max_model_len.
DEFAULT_CONTEXT = 2048


class VllmReplayError(Exception):
    """A vLLM server did not answer a replay as the backend expects."""


def vllm_pools(settings: Settings) -> tuple[VllmPool, ...]:
    """A vLLM-served model's pools: the plain one first, then one per distinct speculative
    configuration, each measured on the first server configured with it."""
    from gateway.backends.vllm import specgate_method

    pools: dict[str, VllmPool] = {}
    for server in settings.backend.vllm_servers:
        config = server.speculative_config if server.resolved_pool == "speculative" else None
        key = json.dumps(config, sort_keys=True)
        if key in pools:
            continue
        k = config.get("num_speculative_tokens") if config else None
        method: Method = specgate_method(config) if config else "none"
        pools[key] = VllmPool(
            server.url.rstrip("/"), config, method, k if isinstance(k, int) else None
        )
    return tuple(sorted(pools.values(), key=lambda pool: pool.method != "none"))


def configured_vllm_models(settings: Settings, client: httpx.Client) -> list[VllmModel]:
    """The vLLM-served models the settings serve, each with the name and context its servers
    list at ``/v1/models`` (asked of each pool's server; a server that does not answer, or
    lists another model, stops the run)."""
    from gateway.backends.vllm import served_version, served_vocab_size

    found = []
    for model in settings.configured_models():
        own = model.settings
        if own.backend.kind != "vllm":
            continue
        pools = vllm_pools(own)
        names, contexts = set(), set()
        for pool in pools:
            server = next(
                s for s in own.backend.vllm_servers if s.url.rstrip("/") == pool.url
            )
            name, context = _listed(client, pool.url, server.served_model_name)
            names.add(name)
            contexts.add(context)
        if len(names) != 1:
            raise VllmReplayError(f"{model.where or 'backend'}: servers serve {sorted(names)}")
        (vllm_name,) = names
        model_dir = next((s.model_dir for s in own.backend.vllm_servers if s.model_dir), None)
        found.append(
            VllmModel(
                name=own.served_model_name or vllm_name,
                aliases=model.aliases,
                vllm_name=vllm_name,
                target=str(model_dir) if model_dir is not None else vllm_name,
                version=served_version(own),
                max_context=min(contexts),
                vocab_size=served_vocab_size(own),
                pools=pools,
            )
        )
    return found


def _listed(client: httpx.Client, url: str, wanted: str | None) -> tuple[str, int]:
    try:
        response = client.get(f"{url}/v1/models")
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        raise VllmReplayError(f"{url}: /v1/models: {error}") from None
    entry = next((m for m in models if wanted in (None, m["id"])), None)
    if entry is None:
        raise VllmReplayError(f"{url} serves {[m['id'] for m in models]}, not {wanted!r}")
    return str(entry["id"]), int(entry.get("max_model_len") or DEFAULT_CONTEXT)


class PoolReplay:
    """Runs a ``PoolVariant`` on its pool's server, timed from request to last token."""

    def __init__(self, client: httpx.Client, vllm_name: str) -> None:
        self.client = client
        self.vllm_name = vllm_name

    def run(
        self,
        variant: Variant,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams | None = None,
    ) -> Run:
        assert isinstance(variant, PoolVariant)
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            sampling=sampling or SamplingParams(max_tokens=max_tokens, temperature=0.0),
            speculative=SpeculativeChoice(method=variant.method),
        )
        body = completion_body(self.vllm_name, request)
        speculative = variant.method != "none"
        before = self._counters(variant.url) if speculative else {}
        tokens: list[int] = []
        figures: dict[str, Any] | None = None
        first: float | None = None
        started = time.perf_counter()
        try:
            with self.client.stream("POST", f"{variant.url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    reply.read()
                    raise VllmReplayError(
                        f"{variant.url} answered {reply.status_code}: {reply.text[:300]}"
                    )
                for line in reply.iter_lines():
                    piece = parse_event(line)
                    if piece is None:
                        continue
                    figures = piece.speculative or figures
                    if piece.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += piece.token_ids
        except (httpx.HTTPError, WireError) as error:
            raise VllmReplayError(f"{variant.url}: {error}") from None
        seconds = time.perf_counter() - started
        stats = GenerationStats(
            method=variant.method,
            num_prompt_tokens=len(prompt_ids),
            num_output_tokens=len(tokens),
            time_to_first_token_s=(first or started + seconds) - started,
            total_time_s=seconds,
            acceptance_source="per_request",
            replica=variant.url,
            max_batch_size=None,
        )
        if speculative:
            spec = self._figures(variant.url, figures, before)
            stats.num_drafts = spec.num_drafts
            stats.num_draft_tokens = spec.num_draft_tokens
            stats.num_accepted_tokens = spec.num_accepted_tokens
            if figures is None:
                stats.acceptance_source = "interval"
        return Run(tuple(tokens), seconds, stats)

    def _counters(self, url: str) -> dict[str, float]:
        try:
            response = self.client.get(f"{url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise VllmReplayError(f"{url}/metrics: {error}") from None
        return spec_counters(response.text)

    def _figures(
        self, url: str, own: dict[str, Any] | None, before: dict[str, float]
    ) -> SpecFigures:
        """The request's own figures where vLLM gave them, else its server's counters'
        increase over the request."""
        if own is not None:
            return request_figures(own)
        return counter_increase(before, self._counters(url))


def measure_vllm_model(
    model: VllmModel,
    requests: Sequence[TuneRequest],
    repeats: int,
    max_tokens: int,
    client: httpx.Client,
) -> ModelRun:
    """Time every pool of ``model`` on every request it can take, interleaved; a request
    whose prompt does not fit the servers' context, or holds tokens the model does not know,
    is counted. Recorded prompts are sent as recorded; a file's body is tokenized by the
    plain pool's server (``/tokenize``: its chat template for ``messages``)."""
    from bench.runner import interleaved_runs

    variants = pool_variants(model)
    methods = [pool.method for pool in model.pools if pool.method != "none"]
    if model.pools[0].method != "none":
        skipped = Counter({"no_plain_vllm_pool": len(requests)})
        return ModelRun(model, model.version, AS_SERVED, methods, variants, [], {}, skipped)
    prompts, skipped = replayable(
        requests,
        lambda request: _prompt_ids(client, model, request),
        model.max_context,
        model.vocab_size,
        max_tokens,
    )
    runs = (
        interleaved_runs(
            PoolReplay(client, model.vllm_name), variants, prompts, repeats,
            label=f"tune {model.name}",
        )
        if prompts
        else {}
    )
    return ModelRun(model, model.version, AS_SERVED, methods, variants, prompts, runs, skipped)


def _prompt_ids(
    client: httpx.Client, model: VllmModel, request: TuneRequest
) -> tuple[int, ...] | None:
    if request.prompt_ids is not None:
        return request.prompt_ids
    body = request.body or {}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        return tuple(prompt)
    if "messages" in body:
        asked: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
    elif isinstance(prompt, str):
        asked = {"prompt": prompt}
    else:
        return None
    url = model.pools[0].url
    try:
        response = client.post(f"{url}/tokenize", json={"model": model.vllm_name, **asked})
    except httpx.HTTPError as error:
        raise VllmReplayError(f"{url}/tokenize: {error}") from None
    if response.status_code != 200:
        return None
    return tuple(int(t) for t in response.json()["tokens"])
