"""CUDA graphs against eager steps on a GPU, in the test suite: the CPU tests check the graph
runner's logic through `eager_capture` (test_native_engine.py), never a captured CUDA graph.

The comparison is `smcspec bench gpu`'s own (`gpu.checks.graphs_vs_eager`, the tolerances
included), on its smoke plan's tiny pair moved to the GPU in bfloat16 (what `auto` picks on
CUDA), with the Triton paged kernel that graphs need: ar, sd and smc tokens for one seed
identical, the logits of a batch padded to its bucket within 2e-2 of eager ones, and at least
one graph replayed (else the comparison proves nothing)."""

import dataclasses

import pytest
import torch

from smcspec.bench.gpu.checks import graphs_vs_eager
from smcspec.bench.gpu.pairs import PAIRS, GpuPlan, build_pair
from smcspec.models import paged_attention

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: compares captured CUDA graphs with eager steps "
        "(on the CPU, test_native_engine.py checks the graph runner through eager_capture)",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and not paged_attention.triton_available("cuda"),
        reason="needs Triton: CUDA graphs run only over the Triton paged-attention kernel",
    ),
]


def test_graph_replays_give_the_eager_tokens_and_logits_on_a_gpu():
    pair_name = next(iter(PAIRS))
    plan = dataclasses.replace(
        GpuPlan.smoke(), device="cuda", dtype="bfloat16", attention="auto", pairs=(pair_name,)
    )
    pair = build_pair(plan, pair_name)
    assert pair.target.attention.graph_safe, "the models run no graph-safe attention"
    rows = graphs_vs_eager(pair, plan)
    assert any(r["check"].endswith("tokens") for r in rows) and len(rows) >= 3
    assert [r["failure"] for r in rows if not r["ok"]] == []
