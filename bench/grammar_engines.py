"""xgrammar against llguidance: the per-token cost of a JSON-schema mask on CPU.

Walks one schema-valid JSON document token by token with each engine's matcher (fill the
next-token bitmask, accept the token) and reports the median microseconds per token, the
compile time, and whether the engine lets a raw control character into a JSON string (strict
JSON, and so Python's ``json`` and pydantic, refuse one). Run:
``python -m bench.grammar_engines [tokenizer dir]`` (default: the demo target's).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerBase

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace, Countess of Lovelace",
        "age": 36,
        "tags": ["mathematician", "writer", "analytical engine", "notes on the engine"],
        "address": {"city": "London, St James's Square", "zip": "SW1Y 4JU"},
    }
)


def _xgrammar(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[float, float, bool]:
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False
    )
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(token)
        times.append(time.perf_counter() - started)
    control = xgr.GrammarMatcher(compiled)
    lets_control_in = control.accept_string('{"name": "\x15')
    return statistics.median(times), compile_s, lets_control_in


def _llguidance(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[float, float, bool]:
    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)  # type: ignore[arg-type]
    grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for token in ids:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(token), matcher.get_error()
        times.append(time.perf_counter() - started)
    control = llguidance.LLMatcher(lltok, grammar)
    lets_control_in = control.consume_tokens(tokenizer.encode('{"name": "\x15')) and not (
        control.is_error()
    )
    return statistics.median(times), compile_s, bool(lets_control_in)


def main(argv: list[str]) -> None:
    source = Path(argv[0]) if argv else Path.home() / ".cache/specgate/demo/target"
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    print(f"tokenizer {source} (vocab {len(tokenizer)}), document of {len(ids)} tokens")
    for name, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        per_token, compile_s, control = run(tokenizer, ids)
        print(
            f"{name:11s} median mask+accept {per_token * 1e6:8.1f} us/token, "
            f"compile {compile_s * 1e3:8.1f} ms, raw control character in a string: "
            f"{'allowed' if control else 'refused'}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
