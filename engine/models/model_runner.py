"""One causal LM with its own KV cache, for batch size one.

The cache always holds the keys and values of a prefix of the sequence; ``truncate`` is the
exact rollback after a rejected proposal (the rejected positions are simply dropped). For
models with recurrent layers (linear attention), whose state cannot be cropped, the runner
keeps a snapshot of that state before each pass since the last rollback; rolling back
restores the snapshot of the pass that crossed the new length and feeds the accepted part
of that pass again (one extra pass over the accepted tokens).

A pass may feed a draft tree instead of a run of tokens: then it takes each fed token's
position (its depth behind the prefix, not its index) and which fed tokens each one sees
(its ancestors), and ``keep_path`` keeps the accepted branch, moving its keys and values
behind the prefix. Only models whose every layer is plain full attention take trees
(``supports_trees``); a chain needs neither positions nor a mask and runs as before.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.models.kv_cache import (
    GrowableLayer,
    RecurrentStates,
    crop_to_snapshot,
    has_recurrent_state,
    new_cache,
    save_recurrent_states,
    supports_trees,
)


class ModelRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.cache = new_cache(model.config)
        self.recurrent = has_recurrent_state(self.cache)
        self.supports_trees = supports_trees(self.cache)
        # Counted here: a cache of recurrent layers only (Mamba) has no sequence length.
        self._length = 0
        # Passes since the last rollback, with recurrent layers: (start, tokens, states before).
        self._passes: list[tuple[int, list[int], RecurrentStates]] = []

    @property
    def length(self) -> int:
        """Number of positions whose keys and values (or recurrent state) are cached."""
        return self._length

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self._length = 0
        self._passes.clear()

    def prefill(self, prompt: list[int], want_hidden: bool = False) -> torch.Tensor | None:
        """Cache ``prompt`` minus its last token (the first decode pass feeds that token),
        from an empty cache. With ``want_hidden``, returns the last hidden states of those
        positions."""
        self.reset()
        if len(prompt) < 2:
            return None
        if want_hidden:
            return self.forward_hidden(prompt[:-1])[1]
        self.forward(prompt[:-1], last_only=True)
        return None

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions. Always crops, also by nothing: that shrinks the
        past that sliding-window and convolution layers recorded since the last call."""
        excess = self.length - length
        if excess < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        passes, self._passes = self._passes, []
        if self.length == 0:
            return  # nothing cached (transformers' layers cannot crop before their first pass)
        if not (self.recurrent and excess):
            self.cache.crop(-excess)
            self._length = length
            return
        crossing = [p for p in passes if p[0] <= length]
        if not crossing:
            raise ValueError(f"no pass since the last rollback starts at or before {length}")
        start, tokens, states = crossing[-1]
        if start == 0:
            self.cache = new_cache(self.model.config)
        else:
            crop_to_snapshot(self.cache, self.length - start, states)
        self._length = start
        if length > start:
            self._run(tokens[: length - start], last_only=True)

    @torch.inference_mode()
    def keep_path(self, committed_len: int, path: list[int] | tuple[int, ...]) -> None:
        """After a pass that fed the last committed token (at ``committed_len - 1``) and a tree
        of nodes (node i at ``committed_len + i``), keep the prefix, that token and the nodes
        on ``path``, contiguously in that order; drop the rest. A chain's path (0..m-1) is a
        plain ``truncate``."""
        if list(path) == list(range(len(path))):
            self.truncate(committed_len + len(path))
            return
        if not self.supports_trees:
            raise ValueError("this model's cache keeps prefixes only; it cannot keep a tree path")
        rows = torch.tensor([committed_len + node for node in path], dtype=torch.long)
        for layer in self.cache.layers:
            assert isinstance(layer, GrowableLayer)
            layer.keep_rows(committed_len, rows)
        self._length = committed_len + len(path)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        last_only: bool = False,
        *,
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` after the cached prefix; returns float32 logits ``[len, vocab]``,
        or ``[1, vocab]`` for the last position only (prefill and drafting need no more, and a
        long prompt's full logits would cost gigabytes).

        For a tree, ``positions`` gives each fed token's position and ``tree_mask``
        (``[len, len]`` bool, ``engine.speculation.tree.ancestor_mask``) which fed tokens each one
        attends to, besides the whole cached prefix."""
        return self._pass(token_ids, last_only, positions, tree_mask, want_hidden=False)[0]

    @torch.inference_mode()
    def forward_hidden(
        self,
        token_ids: list[int],
        *,
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of every fed row, with the target's last hidden states ``[len, hidden]``
        (the input of its LM head), which Medusa and EAGLE heads draft from."""
        logits, hidden = self._pass(token_ids, False, positions, tree_mask, want_hidden=True)
        assert hidden is not None
        return logits, hidden

    def _pass(
        self,
        token_ids: list[int],
        last_only: bool,
        positions: list[int] | None,
        tree_mask: torch.Tensor | None,
        want_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if tree_mask is not None and not self.supports_trees:
            raise ValueError("this model verifies chains only (sliding-window or recurrent layers)")
        if self.recurrent:
            self._passes.append((self.length, list(token_ids), save_recurrent_states(self.cache)))
        return self._run(token_ids, last_only, positions, tree_mask, want_hidden)

    def _run(
        self,
        token_ids: list[int],
        last_only: bool,
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        extra: dict[str, torch.Tensor] = {}
        if positions is not None:
            extra["position_ids"] = torch.tensor([positions], dtype=torch.long, device=self.device)
        if tree_mask is not None:
            extra["attention_mask"] = self._attention_bias(tree_mask)
        captured: list[torch.Tensor] = []
        hook = None
        if want_hidden:
            head = self.model.get_output_embeddings()
            assert head is not None

            def capture(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                captured.append(inputs[0])

            hook = head.register_forward_pre_hook(capture)
        try:
            out = self.model(
                input_ids=ids,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        self._length += len(token_ids)
        hidden = captured[0][0].float() if captured else None
        return out.logits[0].float(), hidden

    def _attention_bias(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """The 4D additive mask of a tree pass: every fed row sees the whole cached prefix,
        and among the fed rows what ``tree_mask`` allows (additive, so that every attention
        implementation, eager included, reads it alike)."""
        fed = tree_mask.shape[0]
        allowed = torch.ones((fed, self.length + fed), dtype=torch.bool)
        allowed[:, self.length :] = tree_mask
        bias = torch.zeros(allowed.shape, dtype=self.model.dtype)
        bias.masked_fill_(~allowed, torch.finfo(self.model.dtype).min)
        return bias.to(self.device)[None, None]
