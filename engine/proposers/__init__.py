"""Proposers: cheap guesses of the target's next tokens."""

from engine.proposers.base import Proposal, Proposer
from engine.proposers.draft import DraftModelProposer
from engine.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "Proposer"]
