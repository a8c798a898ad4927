"""Proposers: cheap guesses of the target's next tokens.

Each speculation method's module here registers it (``engine.speculation.methods``); the registry
imports every module of this package on its first look-up.
"""

from engine.speculation.proposers.base import Proposal, Proposer
from engine.speculation.proposers.draft import DraftProposer
from engine.speculation.proposers.ngram import NgramProposer

__all__ = ["DraftProposer", "NgramProposer", "Proposal", "Proposer"]
