"""A small draft model proposes k tokens autoregressively, for every drafting sequence of a
step together.

``DraftPool`` owns the draft model's runner, a cache slot per request; each request that drafts
holds a ``DraftProposer``, a slot in it. ``DraftPool.propose`` takes every drafting sequence of
a step and runs one draft pass per draft position over all of them: the first feeds what each
sequence's draft cache lacks (its last committed token, plus any accepted tokens the draft never
saw), the next ones the token each has just drawn. A sequence leaves the passes once its
proposal is complete (its k, a token it is unsure of, nothing the constraints allow). Each token
is drawn from the sequence's own generator (``engine.speculation.proposers.drafting``), so a
sequence's draws do not depend on what else drafts beside it.

The runner is a ``BatchedRunner`` where target and draft batch (the passes are shared); for a
draft or target whose cache slots cannot share a pass (sliding-window, chunked or recurrent
layers) it is a ``SerialRunner``, a Hugging Face cache per slot, which runs each pass's feeds
one after another. Either way the same proposer drafts.

A sequence whose draft cache lacks many tokens (the prompt, at its first proposal, or what
the batch committed while it ran plain steps) catches up first (``catch_up``): nothing runs
the draft while a sequence does not propose, and when it proposes again every such sequence
of the step catches up in one shared pass that computes no logits (in the padded batch their
rows would widen every drafting pass). Past its own ``window`` of positions (a draft built for
a shorter context than the target's) the draft steps aside: it proposes nothing and the target
decodes plainly.

Registered as the method ``draft`` (vLLM's ``draft_model``); it loads the model in
``EngineConfig.draft``, recorded in the audit log as a ``draft_model`` artefact. A draft with
another tokenizer proposes through ``engine.speculation.proposers.translating``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from engine.api.types import IncompatibleDraftError, Method, SamplingParams
from engine.models.batched_cache import supports_batching
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import (
    check_draft_compatible,
    context_window,
    embedding_rows,
    input_rows,
    load_model,
    load_tokenizer,
)
from engine.models.model_runner import ModelRunner
from engine.models.packed_linear import pack_linear_weights
from engine.models.serial_runner import SerialRunner
from engine.models.versioning import model_version
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import (
    Artefact,
    ArtefactSpec,
    LoadContext,
    LoadedMethod,
    MethodSpec,
    register,
)
from engine.speculation.proposers.base import Proposal, Proposer, TokenProposer
from engine.speculation.proposers.drafting import DraftHead, Drafting, agreeing_prefix
from engine.speculation.proposers.translating import TranslatingDraftProposer
from engine.speculation.proposers.vocabulary import load_head_vocabulary, restrict_head

# A sequence lacking more than this many tokens in its draft cache catches up first.
SHARED_PENDING_ROWS = 4


class DraftRunner(Protocol):
    """What the pool runs the draft model on: ``BatchedRunner`` or ``SerialRunner``."""

    model: PreTrainedModel
    max_slots: int

    def forward(self, feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]: ...

    def fill(self, feeds: list[Feed]) -> None: ...

    def truncate(self, slot: int, length: int) -> None: ...

    def release(self, slot: int) -> None: ...


class DraftPool:
    """The draft model's runner, its slots (one per request holding a ``DraftProposer``) and
    what it may propose."""

    def __init__(
        self,
        runner: DraftRunner,
        target_ids: int,
        proposable_ids: int,
        window: int,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        self.runner = runner
        self.head = DraftHead(runner.model, target_ids, proposable_ids, vocabulary)
        self.window = window
        self._free = list(range(runner.max_slots))

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("every draft slot is taken")
        slot = self._free.pop(0)
        self.runner.release(slot)
        return slot

    def release(self, slot: int) -> None:
        self.runner.release(slot)
        self._free.append(slot)

    def catch_up(self, requests: list[DraftRequest]) -> int:
        """Feed every request's draft cache what it lacks but the last committed token (that
        one the first drafting pass feeds), in one shared pass over those lacking more than
        ``SHARED_PENDING_ROWS``; the rows fed (0: none needed it)."""
        lagging = [
            request
            for request in requests
            if self._can_draft(request) and request.proposer.catch_up_rows(request.context)
        ]
        if not lagging:
            return 0
        feeds = []
        for request in lagging:
            proposer = request.proposer
            assert proposer.slot is not None, "start() the proposer first"
            feeds.append(Feed(proposer.slot, request.context[len(proposer.cached) : -1]))
        self.runner.fill(feeds)
        for request, feed in zip(lagging, feeds, strict=True):
            request.proposer.cached.extend(feed.tokens)
        return sum(len(feed.tokens) for feed in feeds)

    def _can_draft(self, request: DraftRequest) -> bool:
        """Whether the request gets a proposal: room in the draft's window, and nothing its
        draft cache lacks outside the draft's vocabulary."""
        pending = request.context[len(request.proposer.cached) :]
        return min(request.k, self.window - len(request.context)) > 0 and self.head.readable(
            pending
        )

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Every request's proposal, drafted in shared passes (after ``catch_up``)."""
        self.catch_up(requests)
        proposals = [Proposal([]) for _ in requests]
        live: list[tuple[int, int, DraftProposer, list[int], Drafting]] = []
        for index, request in enumerate(requests):
            proposer, context = request.proposer, request.context
            assert proposer.slot is not None, "start() the proposer first"
            proposer.agreed = len(context)
            if not self._can_draft(request):
                continue
            drafting = Drafting(
                self.head,
                min(request.k, self.window - len(context)),
                request.params,
                request.generator,
                request.min_confidence,
                request.processing,
            )
            live.append((index, proposer.slot, proposer, context[len(proposer.cached) :], drafting))
        while live:
            logits = self.runner.forward([Feed(slot, pending) for _, slot, _, pending, _ in live])
            still = []
            for (index, slot, proposer, pending, drafting), rows in zip(live, logits, strict=True):
                proposer.cached.extend(pending)
                token = drafting.take(rows[-1])
                if token is None:
                    proposals[index] = drafting.proposal()
                else:
                    still.append((index, slot, proposer, [token], drafting))
            live = still
        return proposals


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's part of a shared drafting step (``Proposer.propose``'s arguments)."""

    proposer: DraftProposer
    context: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator
    min_confidence: float = 0.0
    processing: LogitsProcessing | None = None


class DraftProposer(TokenProposer):
    """One request's place in a ``DraftPool``: a draft cache slot and what it holds."""

    method: Method = "draft"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(self, pool: DraftPool) -> None:
        self.pool = pool
        self.slot: int | None = None
        self.cached: list[int] = []  # token ids the slot holds, position for position
        self.agreed = 0  # length of the committed context at the last proposal

    def start(self, prompt_ids: list[int]) -> None:
        self.finish()
        self.slot = self.pool.acquire()

    def finish(self) -> None:
        """The request is done: its slot goes back to the pool."""
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None
        self.cached = []
        self.agreed = 0

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        """This request alone (the shared path is ``DraftPool.propose``)."""
        request = DraftRequest(self, context, k, params, generator, min_confidence, processing)
        return self.pool.propose([request])[0]

    def catch_up_rows(self, context: list[int]) -> int:
        """Tokens of ``context`` a separate catch-up pass must feed before this request can
        draft (``DraftPool.catch_up``): 0 while its cache lacks at most
        ``SHARED_PENDING_ROWS`` (those ride in the first drafting pass)."""
        pending = len(context) - len(self.cached)
        return pending - 1 if pending > SHARED_PENDING_ROWS else 0

    def accepted(self, context: list[int]) -> None:
        # Keep the cached prefix that agrees with the committed context; drop the rest.
        keep = agreeing_prefix(self.cached, self.agreed, context)
        assert self.slot is not None
        self.pool.runner.truncate(self.slot, keep)
        del self.cached[keep:]


def _load(context: LoadContext) -> LoadedMethod:
    """The draft model in ``config.draft``, checked against the target's vocabulary; one with
    another tokenizer proposes through ``TranslatingDraftProposer`` where the configuration
    allows it (``translate_draft_tokens``), else it is refused."""
    config = context.config
    directory = context.artefact_dir(DRAFT)
    assert directory is not None  # EngineConfig refuses the method without one
    target = context.target
    draft_tokenizer = load_tokenizer(directory)
    draft = load_model(directory, target.device, config.dtype)
    try:
        check_draft_compatible(
            context.tokenizer, draft_tokenizer, embedding_rows(draft), embedding_rows(target)
        )
        translated = False
    except IncompatibleDraftError:
        if not config.translate_draft_tokens:
            raise
        translated = True
    artefacts = (Artefact("draft_model", directory.name, model_version(directory)),)
    window = context_window(draft.config)
    target_ids = context.vocab_size

    def calibrate(_proposer: Proposer) -> ModelRunner:
        """A draft's cost per proposed token is one pass of its model (timed on a runner
        of its own, so that no request's cache is touched)."""
        return ModelRunner(draft)

    if translated:  # a translated draft keeps its full head, over its own ids
        pack_linear_weights(draft)
        tokenizer = context.tokenizer
        return LoadedMethod(
            lambda: TranslatingDraftProposer(
                ModelRunner(draft), tokenizer, draft_tokenizer, target_ids=target_ids, window=window
            ),
            artefacts,
            calibrate=calibrate,
        )
    vocabulary = load_head_vocabulary(directory, embedding_rows(draft))
    if vocabulary is not None:
        restrict_head(draft, vocabulary)
    pack_linear_weights(draft)  # after the head is cut: it packs the head it serves
    proposable = min(len(context.tokenizer), input_rows(draft), target_ids)
    # A slot per running sequence, and one more for the engine's own proposer instance.
    slots = config.max_num_seqs + 1
    runner: DraftRunner
    if supports_batching(target.config) and supports_batching(draft.config):
        # Shared passes; only a batching target runs more than one sequence at a time.
        runner = BatchedRunner(draft, slots, config.batch_invariant)
    else:
        runner = SerialRunner(*(ModelRunner(draft) for _ in range(slots)))
    pool = DraftPool(runner, target_ids, proposable, window, vocabulary)
    return LoadedMethod(lambda: DraftProposer(pool), artefacts, calibrate=calibrate)


DRAFT = register(
    MethodSpec(
        name="draft",
        vllm_names=("draft_model", "draft"),
        artefact=ArtefactSpec("draft_model", "draft", "draft model"),
        model_based=True,
        load=_load,
    )
)
