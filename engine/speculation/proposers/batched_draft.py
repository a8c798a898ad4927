"""A draft model drafting for every sequence of a batch in shared passes.

``BatchedDraft`` owns one slot cache of the draft model (``engine.models.batched_runner``); each
request that drafts holds a ``BatchedDraftProposer``, a slot in it. ``BatchedDraft.propose``
takes every drafting sequence of a step and runs one draft pass per draft position over all
of them: the first feeds what each sequence's draft cache lacks (its last committed token,
plus any accepted tokens the draft never saw), the next ones the token each has just drawn.
A sequence leaves the pass once its proposal is complete (its k, a token it is unsure of,
nothing the constraints allow). Each token is drawn exactly as ``DraftModelProposer`` draws
it (``Drafting``), from the sequence's own generator, so a sequence's draws do not depend on
what else drafts beside it.

A sequence whose draft cache lacks many tokens (the prompt, at its first proposal, or what
the batch committed while it ran plain steps) catches up first (``catch_up``): nothing runs
the draft while a sequence does not propose, and when it proposes again every such sequence
of the step catches up in one shared pass that computes no logits (in the padded batch their
rows would widen every drafting pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.api.types import Method, SamplingParams
from engine.models.batched_runner import BatchedRunner, Feed
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.proposers.base import Proposal, TokenProposer
from engine.speculation.proposers.draft import DraftHead, Drafting, agreeing_prefix

# A sequence lacking more than this many tokens in its draft cache catches up first.
SHARED_PENDING_ROWS = 4


class BatchedDraft:
    def __init__(
        self,
        model: PreTrainedModel,
        max_slots: int,
        target_ids: int,
        proposable_ids: int,
        window: int,
        vocabulary: torch.Tensor | None = None,
        invariant: bool = False,
    ) -> None:
        self.runner = BatchedRunner(model, max_slots, invariant)
        self.head = DraftHead(model, target_ids, proposable_ids, vocabulary)
        self.window = window
        self._free = list(range(max_slots))

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
        live: list[tuple[int, int, BatchedDraftProposer, list[int], Drafting]] = []
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

    proposer: BatchedDraftProposer
    context: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator
    min_confidence: float = 0.0
    processing: LogitsProcessing | None = None


class BatchedDraftProposer(TokenProposer):
    """One request's place in a ``BatchedDraft``: a draft cache slot and what it holds."""

    method: Method = "draft"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(self, drafts: BatchedDraft) -> None:
        self.drafts = drafts
        self.slot: int | None = None
        self.cached: list[int] = []  # token ids the slot holds, position for position
        self.agreed = 0  # length of the committed context at the last proposal

    @property
    def runner(self) -> BatchedRunner:
        """The shared draft runner (its ``model`` is the draft model)."""
        return self.drafts.runner

    def start(self, prompt_ids: list[int]) -> None:
        self.finish()
        self.slot = self.drafts.acquire()

    def finish(self) -> None:
        """The request is done: its slot goes back to the pool."""
        if self.slot is not None:
            self.drafts.release(self.slot)
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
        """This request alone (the shared path is ``BatchedDraft.propose``)."""
        request = DraftRequest(self, context, k, params, generator, min_confidence, processing)
        return self.drafts.propose([request])[0]

    def catch_up_rows(self, context: list[int]) -> int:
        """Tokens of ``context`` a separate catch-up pass must feed before this request can
        draft (``BatchedDraft.catch_up``): 0 while its cache lacks at most
        ``SHARED_PENDING_ROWS`` (those ride in the first drafting pass)."""
        pending = len(context) - len(self.cached)
        return pending - 1 if pending > SHARED_PENDING_ROWS else 0

    def accepted(self, context: list[int]) -> None:
        keep = agreeing_prefix(self.cached, self.agreed, context)
        assert self.slot is not None
        self.drafts.runner.truncate(self.slot, keep)
        del self.cached[keep:]
