"""Proposers: cheap guesses of the target's next tokens.

Each speculation method's module here registers it (``engine.methods``); the registry imports
every module of this package on its first look-up.
"""

from engine.proposers.base import Proposal, Proposer
from engine.proposers.draft import DraftModelProposer
from engine.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "Proposer"]
