"""The KV pools' budget: the pages a request can hold at most, whether that fits, and auto's
settings cut down until they fit.

A request keeps rows[m] sequences of up to `max_length` positions in model m's pool (its
method's `kv_rows` and `lookahead`, `engine.request`). The scheduler admits it by that bound;
a lone `generate` checks it before decoding, so that a pool too small fails at once with the
pool named, never mid-decode. auto's bound is the most any setting it weighs could keep; where
that does not fit, auto weighs only the settings that do (`fit_auto`): fewer particles, then
fewer drafts, then ar, which any pool that holds the request at all can run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from smcspec.config import ARConfig, AutoConfig, DecodingConfig
from smcspec.decoding import methods
from smcspec.models.base import CausalLM, PagedModel


def pages_for(models: Sequence[CausalLM], rows: Sequence[int], max_length: int) -> list[int]:
    """The most pages a job can hold with rows[m] sequences of up to `max_length` positions
    in model m's pool: a page per page_size positions per row (a shared last page is copied
    only while another row still holds it, so the copies never outnumber the rows; prefix
    sharing only makes the need smaller), plus one spare page per row: measured peaks never
    use it (tests/engine/test_admission.py), but a page missing mid-decode fails a running
    job, where a spare one only delays admission. 0 for a model without a paged pool."""
    out = []
    for model, n in zip(models, rows, strict=True):
        if not isinstance(model, PagedModel) or n == 0:
            out.append(0)
            continue
        out.append(n * (-(-max_length // model.page_size) + 1))
    return out


def oversized(models: Sequence[CausalLM], rows: Sequence[int], max_length: int) -> str | None:
    """Why a job of that size can never fit the pools (more pages than one holds), or None."""
    for i, (model, need) in enumerate(
        zip(models, pages_for(models, rows, max_length), strict=True)
    ):
        if not isinstance(model, PagedModel):
            continue
        cap = model.pages.num_pages
        if need > cap:
            return (
                f"the request needs up to {need} KV pages of model {i}, the pool has {cap} "
                f"({cap} pages x {model.page_size} positions): ask for fewer tokens or "
                "particles, or give a larger pool (--kv-pages or --kv-memory; "
                "EngineLimits.kv_pages or kv_memory)"
            )
    return None


def fit_auto(
    decoding: DecodingConfig,
    models: Sequence[CausalLM],
    prompt_len: int,
    max_new_tokens: int,
    has_potential: bool,
) -> DecodingConfig:
    """auto's settings cut down to the largest that fit the pools (`_smaller`'s order); any
    other method's, or an auto that fits or cannot shrink to a fit, unchanged (the caller's
    size check then refuses it)."""
    if not methods.row_of(decoding).chooses:
        return decoding
    for option in _smaller(decoding, has_potential):  # type: ignore[arg-type]
        length = prompt_len + max_new_tokens + methods.lookahead(option)
        if oversized(models, methods.kv_rows(option), length) is None:
            return option
    return decoding


def _smaller(config: AutoConfig, has_potential: bool) -> Iterator[DecodingConfig]:
    """config, then with half the most particles (down to 1, or 2 where smc may run: it needs a
    population), then with half the most drafts (down to 1), then ar. What a request gave
    itself (N, K) is never cut, and with a potential or a given N or K ar is no option."""
    yield config
    least = 2 if has_potential or not config.exact else 1
    while config.particles is None and config.max_particles // 2 >= least:
        config = dataclasses.replace(config, max_particles=config.max_particles // 2)
        yield config
    while config.draft_tokens is None and config.max_draft_tokens > 1:
        config = dataclasses.replace(config, max_draft_tokens=config.max_draft_tokens // 2)
        yield config
    if not (has_potential or config.particles or config.draft_tokens):
        yield ARConfig()
