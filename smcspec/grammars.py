"""Grammars for constraints: a regex, a JSON schema or a Lark grammar compiled to llguidance's
grammar and checked before any model loads, under limits no request can raise; the regexes a
grammar's JSON schemas hold; llguidance's view of a tokenizer; its messages cut to one line."""

from __future__ import annotations

import json
import re
from typing import Any

# llguidance's limits on one grammar, passed explicitly so that no request can raise them:
# - max_grammar_size (symbols in the productions; llguidance's default 500k): an object of 5,000
#   optional properties (OpenAI's own cap on properties) has ~40k and compiles in 2.6 s, one of
#   10,000 ~80k and 8 s (the time grows as its square; measured on a 2-core Xeon), so the
#   default allowed minutes of a core per request.
# - max_lexer_states (default 250k, at 1-2 kB each by llguidance's count): 50k bounds the lexer
#   near 100 MB; a 5,000-token JSON decode with Qwen2.5's tokenizer needed under 200.
# - initial_lexer_fuel, step_lexer_fuel: llguidance's defaults, tuned on real JSON schemas. A
#   regex that exhausts them (a{1000000}) costs about 1 s of CPU and 20-60 MB before the lexer
#   gives up, which `Constraint` makes happen up front (see `PROBE_TOKENS`).
GRAMMAR_LIMITS = {
    "max_grammar_size": 50_000,
    "max_lexer_states": 50_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
}


def llguidance_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of `tokenizer` (an `llguidance.LLTokenizer` as it is). llguidance reads
    transformers' fast tokenizers, so smcspec's stored one (`tokenizer_cache.CachedTokenizer`)
    hands over the transformers tokenizer it stands for."""
    import llguidance

    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    import llguidance.hf

    tokenizer = getattr(tokenizer, "transformers_tokenizer", tokenizer)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def grammar_limits() -> Any:
    """`GRAMMAR_LIMITS` as llguidance takes them."""
    import llguidance

    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def patterns(grammar: str) -> list[str]:
    """The regexes of the JSON schemas in an llguidance grammar, each once: `pattern` strings
    and `patternProperties` keys, in a top-level schema or after a Lark grammar's `%json`."""
    try:
        top = json.loads(grammar)
    except ValueError:
        top = None
    schemas: list[Any] = []
    larks: list[str] = []
    if isinstance(top, dict):
        for part in top.get("grammars") or []:
            if isinstance(part, dict):
                schemas.append(part.get("json_schema"))
                larks.append(part.get("lark_grammar") or "")
    else:
        larks.append(grammar)
    for lark in larks:
        schemas.extend(_embedded_schemas(lark))
    found: dict[str, None] = {}
    stack = schemas
    while stack:  # a loop, not recursion: schemas may nest hundreds deep
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(node.values())
    return list(found)


def _embedded_schemas(lark: str) -> list[Any]:
    """The JSON value after each `%json` of a Lark grammar."""
    decoder = json.JSONDecoder()
    out = []
    for match in re.finditer(r"%json\s*", lark):
        try:
            out.append(decoder.raw_decode(lark, match.end())[0])
        except ValueError:
            continue
    return out


def first_line(message: str) -> str:
    """llguidance's error without the parser state it appends."""
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


_KINDS = {"regex": "regex", "json_schema": "JSON schema", "grammar": "grammar"}


def grammar_of(kind: str, text: str | dict) -> str:
    """The llguidance grammar of a `regex`, a `json_schema` (JSON text or a dict) or a Lark
    `grammar`, compiled and checked without a tokenizer, so a malformed one fails before any
    model loads."""
    import llguidance

    if kind not in _KINDS:
        raise ValueError(f"constraint kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    what = _KINDS[kind]
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            schema = json.loads(text) if isinstance(text, str) else text
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as err:
        raise ValueError(f"invalid {what}: {_one_line(str(err))}") from err
    validate(grammar, None, what)
    return grammar


def validate(grammar: str, tokenizer: Any, what: str) -> None:
    """Refuse, naming the `what` (regex, JSON schema, grammar) in one line, a grammar llguidance
    rejects under `GRAMMAR_LIMITS` (against `tokenizer`, or none)."""
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=grammar_limits()
    )
    if failed:
        message = _one_line(messages[0]) if messages else "rejected"
        if what == "regex":  # the position is in llguidance's wrapper grammar, not the regex
            message = re.sub(r"^at \d+\(\d+\): ", "", message)
        raise ValueError(f"invalid {what}: {message}")


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt: the first line and any "error:" line,
    so the CLI can print it as one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "rejected"
    causes = [
        line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")
    ]
    return " ".join([lines[0], *causes])
