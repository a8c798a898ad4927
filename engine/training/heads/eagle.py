"""The EAGLE draft: one decoder layer over the target's own features.

At position t the draft reads the target's feature f_t (the input of its LM head there) and
the embedding of the token x_{t+1} that followed, fuses them (``fc``: concat -> hidden), runs
one Llama-style decoder layer over them (attending to the earlier positions through its own
small KV cache) and predicts the next feature f_{t+1}; the target's (frozen, shared) LM head
turns that into a distribution over x_{t+2}. Deeper guesses feed the draft its own predicted
features. The target's embedding and LM head are shared, not stored: the draft costs one
layer and the fusion matrix. With a draft vocabulary (``engine.training.heads.vocabulary``,
EAGLE-3's ``d2t``/``t2d``) the draft reads only the LM head's rows for the tokens the target writes
most, which makes each tree level several times cheaper.

On disk (vLLM's ``speculators`` format, so EAGLE heads converted by ``speculators`` load):
``config.json`` with ``speculators_model_type: "eagle"``, ``transformer_layer_config`` (a
Llama layer's sizes), ``layernorms``, ``fusion_bias`` and ``speculators_config`` (algorithm,
proposal method, verifier), plus the ``target_model_version`` the draft was trained on;
weights in ``model.safetensors`` named ``fusion_fc.*`` and ``transformer.*`` (the layer's
Llama names), and with ``layernorms`` ``embedding_layernorm.weight`` and
``pre_lm_head_layernorm.weight``; a draft vocabulary adds ``d2t`` and ``t2d`` and
``draft_vocab_size`` in the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine.training.heads import HeadsMismatchError
from engine.training.heads.checkpoint import CONFIG_FILE, WEIGHTS_FILE, Target, read_checkpoint
from engine.training.heads.vocabulary import DraftHead, extra_bytes

# The target's own tensors a ``speculators`` checkpoint may carry; Specgate shares the
# target's instead of loading copies.
_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    layernorms: bool = False
    fusion_bias: bool = False
    speculative_tokens: int = 5
    verifier_name: str | None = None
    verifier_architectures: tuple[str, ...] = ()
    target_model_version: str | None = None
    draft_vocab_size: int | None = None  # None: the target's whole head

    @classmethod
    def for_target(
        cls, target_config: Any, vocab_size: int, name: str | None, version: str | None
    ) -> EagleConfig:
        """A draft layer shaped like one of the target's layers."""
        heads = int(target_config.num_attention_heads)
        hidden = int(target_config.hidden_size)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(target_config.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
            vocab_size=vocab_size,
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(target_config),
            verifier_name=name,
            verifier_architectures=tuple(getattr(target_config, "architectures", None) or ()),
            target_model_version=version,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "transformer_layer_config": {
                "model_type": "llama",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": 1,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
            },
            "layernorms": self.layernorms,
            "fusion_bias": self.fusion_bias,
            "speculators_config": {
                "algorithm": "eagle",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier_name,
                    "architectures": list(self.verifier_architectures),
                },
            },
            "target_model_version": self.target_model_version,
            **(
                {"draft_vocab_size": self.draft_vocab_size}
                if self.draft_vocab_size is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: Path) -> EagleConfig:
        if raw.get("speculators_model_type") != "eagle":
            raise HeadsMismatchError(
                f"{where} holds no EAGLE draft (speculators_model_type is "
                f"{raw.get('speculators_model_type')!r}, not 'eagle')"
            )
        layer = raw.get("transformer_layer_config") or {}
        if raw.get("transformer_layer_architecture", "LlamaDecoderLayer") != "LlamaDecoderLayer":
            raise HeadsMismatchError(
                f"{where}: only LlamaDecoderLayer EAGLE drafts are supported, not "
                f"{raw['transformer_layer_architecture']}"
            )
        heads = int(layer["num_attention_heads"])
        hidden = int(layer["hidden_size"])
        rope = layer.get("rope_parameters") or {}
        spec = raw.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        return cls(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=int(layer["vocab_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", rope.get("rope_theta", 10000.0))),
            layernorms=bool(raw.get("layernorms", False)),
            fusion_bias=bool(raw.get("fusion_bias", False)),
            speculative_tokens=int(methods[0].get("speculative_tokens", 5)),
            verifier_name=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            target_model_version=raw.get("target_model_version"),
            draft_vocab_size=raw.get("draft_vocab_size"),
        )


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    return float(getattr(config, "rope_theta", None) or 10000.0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.dim = (
            config.num_attention_heads, config.num_key_value_heads, dim,
        )
        self.q_proj = nn.Linear(hidden, self.heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(self.heads * dim, hidden, bias=False)
        self.rope_theta = config.rope_theta

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[batch, n, hidden]`` at ``positions`` ``[n]``; ``past`` keys/values
        ``[batch, kv_heads, P, dim]``; ``allowed`` ``[n, P + n]`` bool. Returns the output and
        the new rows' keys and values (for the caller's cache)."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.heads, self.dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.dim).transpose(1, 2)
        # Angles in float32 whatever the weights' dtype (bf16 positions lose whole steps).
        steps = torch.arange(0, self.dim, 2, device=x.device).float() / self.dim
        freqs = positions.float()[:, None] / (self.rope_theta**steps)[None]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        group = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q,
            keys.repeat_interleave(group, dim=1),
            values.repeat_interleave(group, dim=1),
            attn_mask=allowed,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1)), k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class _DecoderLayer(nn.Module):
    """A Llama decoder layer; with ``layernorms`` off its input norm is skipped, as EAGLE's."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.input_layernorm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if config.layernorms else None
        )
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed = self.input_layernorm(x) if self.input_layernorm is not None else x
        attended, k, v = self.self_attn(normed, positions, past, allowed)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class EagleDraft(nn.Module):
    def __init__(
        self,
        config: EagleConfig,
        embed: nn.Module,
        lm_head: nn.Module,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        """``vocabulary``: the draft vocabulary's target ids (None: the whole LM head)."""
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embedding_layernorm = (
            RMSNorm(hidden, config.rms_norm_eps) if config.layernorms else None
        )
        self.fusion_fc = nn.Linear(2 * hidden, hidden, bias=config.fusion_bias)
        self.transformer = _DecoderLayer(config)
        self.pre_lm_head_layernorm = (
            RMSNorm(hidden, config.rms_norm_eps) if config.layernorms else None
        )
        # The target's embedding, not a parameter of the draft (kept out of state_dict and
        # of the optimiser), and its LM head (or the draft vocabulary's rows of it).
        self._shared = (embed,)
        self.head = DraftHead(lm_head, vocabulary)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted next features ``[batch, n, hidden]`` from target (or predicted) features
        ``[batch, n, hidden]`` and the tokens that followed them ``[batch, n]``, at
        ``positions`` ``[n]``, after ``past`` cached keys/values; ``allowed`` ``[n, P + n]``
        (None: causal). Also returns the new rows' keys and values."""
        n = tokens.shape[-1]
        if allowed is None:
            cached = 0 if past is None else past[0].shape[2]
            allowed = torch.ones((n, cached + n), dtype=torch.bool, device=tokens.device)
            allowed[:, cached:] = torch.ones((n, n), dtype=torch.bool).tril()
        embedded = self._shared[0](tokens)
        if self.embedding_layernorm is not None:
            embedded = self.embedding_layernorm(embedded)
        fused = self.fusion_fc(torch.cat((embedded, features.to(embedded.dtype)), dim=-1))
        out, k, v = self.transformer(fused, positions, past, allowed)
        return out, k, v

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """The target's LM head over predicted features: logits of the token after next,
        over the draft vocabulary (``to_target`` names their tokens)."""
        if self.pre_lm_head_layernorm is not None:
            predicted = self.pre_lm_head_layernorm(predicted)
        result: torch.Tensor = self.head(predicted)
        return result

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of ``logits``' indices."""
        return self.head.to_target(indices)

    def extra_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_bytes(self) -> int:
        """Memory the draft adds to the target's (a draft vocabulary's rows included)."""
        return extra_bytes(self)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous().cpu() for name, t in self.state_dict().items()}
        tensors.update(self.head.tensors(self.config.vocab_size))
        save_file(tensors, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(self.config.as_dict(), indent=2) + "\n")


class EagleCache:
    """The draft's keys and values of committed positions, plus a proposal's tree rows
    appended after them; ``truncate`` rolls back to a length."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.keys is None or self.values is None else (self.keys, self.values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat((self.keys, keys), dim=2)
            self.values = torch.cat((self.values, values), dim=2)

    def truncate(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def reset(self) -> None:
        self.keys = self.values = None


def read_config(heads_dir: Path) -> EagleConfig:
    return EagleConfig.from_dict(json.loads((heads_dir / CONFIG_FILE).read_text()), heads_dir)


def load_eagle(
    heads_dir: Path,
    embed: nn.Module,
    lm_head: nn.Module,
    hidden_size: int,
    vocab_size: int,
    target_version: str,
) -> EagleDraft:
    """Load an EAGLE draft for this target; one trained on another version of it is refused,
    naming both versions (its guesses would be for a model that is not running)."""
    config = read_config(heads_dir)
    target = Target(target_version, hidden_size, vocab_size)
    checkpoint = read_checkpoint("eagle", heads_dir, config, target)
    tensors = {
        name: t for name, t in checkpoint.weights.items() if name not in _SHARED_WITH_TARGET
    }
    draft = EagleDraft(config, embed, lm_head, checkpoint.vocabulary)
    expected = set(draft.state_dict())
    missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unknown:
        raise HeadsMismatchError(
            f"EAGLE heads in {heads_dir} do not match their config: missing "
            f"{', '.join(missing[:3]) or 'nothing'}, unknown {', '.join(unknown[:3]) or 'nothing'}"
        )
    draft.load_state_dict(tensors)
    return draft.eval()
