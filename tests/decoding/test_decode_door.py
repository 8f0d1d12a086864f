"""`Decoder.decode`, every method's one public door (`decoding.base`): each method writes only
`_decode(call)`, and the door runs it without autograd, so no round records a graph for its
hundred small operations, whichever method or front end asks."""

from __future__ import annotations

import pytest
import torch

from smcspec import LLM
from smcspec.decoding.base import Call, Decoder
from smcspec.models.toy import perturbed_lm, random_lm


@pytest.fixture(scope="module")
def toy_llm() -> LLM:
    target = random_lm(6, seed=3)
    return LLM.from_models(target, perturbed_lm(target, seed=4, noise=0.5))


@pytest.mark.parametrize("method", ["ar", "sd", "msd", "smc", "auto"])
def test_every_method_decodes_without_autograd(method, toy_llm, monkeypatch):
    """Failed on: `Decoder.decode` calling `_decode` outside `no_autograd()`."""
    toy_llm.prepare()  # auto's start-up profile times passes outside any decode
    seen: list[bool] = []
    forward = toy_llm.target.forward

    def spy(*args, **kwargs):
        seen.append(torch.is_inference_mode_enabled())
        return forward(*args, **kwargs)

    monkeypatch.setattr(toy_llm.target, "forward", spy)
    result = toy_llm.generate([1, 2], method, max_new_tokens=6, seed=0, stop_at_eos=False)
    assert len(result.token_ids) == 6
    assert seen and all(seen), seen
    assert not torch.is_inference_mode_enabled()  # the mode ends with the call


def test_the_door_hands_its_four_arguments_to_decode_as_one_call():
    class Echo(Decoder):
        def _decode(self, call: Call):
            return call

    generator = torch.Generator()
    watch = print
    assert Echo().decode([1], "s", generator, watch) == Call([1], "s", generator, watch)
    assert Echo().decode([1], "s", generator).watch is None
