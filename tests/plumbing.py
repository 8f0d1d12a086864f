"""What the plumbing tests share, none of them calling the code they judge: what reached the
decoder, the text a token list must read as, and a model's next-token law from transformers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from smcspec.potentials import Potential, Product


def record_decoders(monkeypatch: Any) -> list[tuple[Any, Potential | None]]:
    """Every (decoding config, potential) that `engine.llm.make_decoder` gets from now on, in
    call order: the one door every front end (generate, the CLI, the server's jobs) goes through
    to a decoder, so what is recorded is what decodes."""
    import smcspec.engine.llm as engine_llm

    seen: list[tuple[Any, Potential | None]] = []
    real = engine_llm.make_decoder

    def spy(decoding, target, draft, potential, tuner=None):
        seen.append((decoding, potential))
        return real(decoding, target, draft, potential, tuner)

    monkeypatch.setattr(engine_llm, "make_decoder", spy)
    return seen


def factor(potential: Potential | None, kind: type) -> Any:
    """The one factor of type `kind` in a potential (itself, or one part of a product)."""
    parts = potential.parts if isinstance(potential, Product) else [potential]
    found = [p for p in parts if isinstance(p, kind)]
    assert len(found) == 1, f"want one {kind.__name__} factor, the potential has {parts}"
    return found[0]


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` before the stop string that is completed first (the longest of those completed
    at the same character), all of it without one."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return text[: min(hits)[1]] if hits else text


def check_text(
    decode: Callable[[list[int]], str], text: str, ids: list[int], stops: Sequence[str]
) -> bool:
    """Assert that `text` is decode(ids) cut before the first stop string and, when a stop
    string shows, that ids end at the token completing it. Whether a stop string showed."""
    full = decode(ids)
    assert text == cut_at_stop(full, stops), (text, full, ids)
    hit = cut_at_stop(full, stops) != full
    if hit:
        assert cut_at_stop(decode(ids[:-1]), stops) == decode(ids[:-1]), (ids, stops)
    return hit


def returned_is_not_the_first(out: Any) -> bool:
    """For an smc result (others: False): assert that its particles disagree, and say whether
    the returned one is not particle 0 (a text taken from particle 0 would then be caught)."""
    if out.particle_texts is None:
        return False
    assert len(set(out.particle_texts)) > 1, "the particles must disagree"
    return out.particle_texts[out.diagnostics["chosen_particle"]] != out.particle_texts[0]


def byte_pair(tmp_path_factory: Any) -> Any:
    """An `LLM` over a tiny random pair with a byte-level tokenizer (which llguidance reads, so
    constraints compile against it)."""
    from smcspec import LLM
    from tests.server.test_tools import save_byte_model

    folders = [tmp_path_factory.mktemp(name) for name in ("byte-target", "byte-draft")]
    for seed, folder in enumerate(folders):
        save_byte_model(folder, seed)
    return LLM(str(folders[0]), str(folders[1]), backend="native", dtype="float32")


def next_token_log_probs(folder: str, ids: list[int]) -> torch.Tensor:
    """log p(. | ids) [V] in float64, from transformers' own model of a saved folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
    return torch.log_softmax(logits.double(), dim=-1)
