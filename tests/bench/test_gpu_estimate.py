"""The H200 estimate (`bench.gpu.estimate`): its formulas against numbers worked by hand, its
monotonicity where a swapped argument would show, and the script's table.

Each was run against a broken copy of the module in a private clone, and failed on it:
- the floor: 2 x bytes / bandwidth (the bench's old half-bandwidth floor); the LM head left out;
- attention bytes by hand: the old kernel's reads per kv head, not per query head; keys seen
  off by one (t(t-1)/2); K without V; the new kernel reading per query token; rows for t;
- rows vs new tokens: rows and t swapped in pass_cost's attention call, or in attention_bytes;
- the context: attention called with t in the context's place;
- the old kernel's waves: one wave assumed; the new kernel's splits (and plan's): no cap of 16,
  a fill of one wave, 64-row tiles for a decode step;
- costlier draft / target: draft steps priced on the target; the round by hand: the verify
  priced on the draft, one host wait whatever the design or method, ar without its wait;
- sd vs acceptance: K+1 tokens for sd; a sampling call: no logits traffic, traffic per draw,
  the flat scan's 8-row cost at one row; the slow end: a faster kernel cost there;
- targets: the strict 15% made <=; acceptance: the mean of per-run rates, hf runs counted.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from smcspec.bench.gpu import estimate as ge
from smcspec.bench.gpu.pairs import load_config
from smcspec.bench.gpu.runner import weight_bytes as bench_weight_bytes
from smcspec.models import paged_attention
from smcspec.models.llama import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
A = ge.Assumptions()
OLD = ge.old_design(ge.per_layer_launches(34, 13), "34 a layer (test)")
NEW = ge.new_design(ge.per_layer_launches(9, 6), "9 a layer (test)")
# 2 layers, 4 query heads on 2 kv heads (GROUP 2), head_dim 8: one key's K and V of one kv
# head are 2 x 8 x 2 = 32 bf16 bytes
TINY = ge.ModelShape("tiny", 2, 32, 64, 4, 2, 8, 100)
SEVEN_B = ge.ModelShape.load("qwen2.5-7b-instruct")


def test_the_floor_is_the_weight_bytes_over_the_read_bandwidth_not_half_of_it():
    # 28 x (3584 x 128 x (2 x 28 + 2 x 4) + 3 x 3584 x 18944) + 152064 x 3584 parameters
    assert ge.weight_bytes(SEVEN_B) == 2 * 7_070_285_824
    assert ge.floor_s(SEVEN_B, A) == pytest.approx(14_140_571_648 / 4.3e12)  # 3.29 ms
    faster = replace(A, hbm_bytes_per_s=8.6e12)
    assert ge.floor_s(SEVEN_B, faster) == pytest.approx(14_140_571_648 / 8.6e12)


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "qwen2.5-coder-1.5b-instruct",
                                  "qwen2.5-coder-0.5b-instruct"])  # fmt: skip
def test_weight_bytes_agree_with_the_gpu_bench(name):
    config = LlamaConfig.from_hf(load_config(name))
    assert ge.weight_bytes(ge.ModelShape.load(name)) == bench_weight_bytes(config, "bfloat16")


def test_attention_bytes_of_a_tiny_shape_worked_by_hand():
    # 3 sequences x 2 new tokens after 5 cached keys: the tokens see 6 and 7 keys
    # old: every (token, query head) walks its keys: 2 layers x 3 x 4 heads x 13 x 32 B
    assert ge.attention_bytes(TINY, 3, 2, 5, split_kv=False) == 2 * 3 * 4 * 13 * 32 == 9984
    # new: each (sequence, kv head) reads its 7 keys once: 2 layers x 3 x 2 x 7 x 32 B
    assert ge.attention_bytes(TINY, 3, 2, 5, split_kv=True) == 2 * 3 * 2 * 7 * 32 == 2688


def test_rows_and_new_tokens_are_not_interchangeable():
    """Nine sequences of one token read nine sequences' keys; one sequence of nine tokens reads
    its keys once in the new design but GROUP x 9 times in the old one."""

    def kv(rows, t, split_kv):
        return ge.attention_bytes(SEVEN_B, rows, t, 512, split_kv)

    new_rows, new_tokens = kv(9, 1, True), kv(1, 9, True)
    old_rows, old_tokens = kv(9, 1, False), kv(1, 9, False)
    assert new_rows > 8 * new_tokens
    assert old_tokens > old_rows
    # and a pass prices its own rows and tokens: 9 sequences' keys take longer than one's
    nine_rows, nine_tokens = (
        ge.pass_cost(SEVEN_B, r, t, 4096, NEW, A) for r, t in [(9, 1), (1, 9)]
    )
    assert nine_rows.attention_s > 2 * nine_tokens.attention_s


def test_the_old_kernel_decode_step_is_its_serial_loop():
    # 28 programs (one wave): ceil(513 / 32) = 17 key blocks x 1.7 us, 28 layers
    assert ge.attention_s(SEVEN_B, 1, 1, 512, False, A) == pytest.approx(28 * 17 * 1.7e-6)


def test_the_old_kernel_loop_runs_in_waves_of_resident_programs():
    # one program resident a multiprocessor: 8 x 9 tokens x 28 heads = 2016 programs are 16
    # waves of 132, each 17 key blocks (ceil(521 / 32)) x 1.7 us, 28 layers
    one_per_sm = replace(A, ctas_per_sm=1)
    assert ge.attention_s(SEVEN_B, 8, 9, 512, False, one_per_sm) == pytest.approx(
        28 * 16 * 17 * 1.7e-6
    )


def test_the_new_kernel_splits_a_decode_step_sixteen_ways():
    # tile rows 16 (GROUP 7 -> 2 tokens a q-block), 1 q-block x 4 kv heads; S = min(16 splits,
    # 17 key tiles, ceil(2 x 132 / 4) = 66) = 16, so ceil(17 / 16) = 2 steps of 1 us a layer
    launch = ge.split_launch(SEVEN_B, 1, 1, 512, A)
    assert (launch.block_q, launch.splits, launch.programs) == (2, 16, 64)
    assert ge.attention_s(SEVEN_B, 1, 1, 512, True, A) == pytest.approx(28 * 2 * 1e-6)
    # a 9-token verify of 8 sequences: 64-row tiles (9 tokens x 7 heads), 16 q-block rows
    assert ge.split_launch(SEVEN_B, 8, 9, 512, A).splits == 5  # ceil(264 / (16 x 4))


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_the_split_count_is_the_kernels_own(name):
    """`split_launch` mirrors `paged_attention.plan` (bf16; the estimate caps the splits by the
    context's key tiles, where the kernel takes the table's: the same max_keys here)."""
    shape = ge.ModelShape.load(name)
    for rows, t, context in [(1, 1, 512), (8, 1, 512), (1, 5, 2048), (8, 9, 2048), (32, 1, 64)]:
        mine = ge.split_launch(shape, rows, t, context, A)
        kernel = paged_attention.plan(
            rows * t, rows, shape.heads, shape.kv_heads, shape.head_dim, context + t
        )
        assert (mine.block_q, mine.splits) == (kernel.block_q, kernel.splits), (rows, t, context)
        assert kernel.block_n == shape.block_n


@pytest.mark.parametrize("design", [OLD, NEW], ids=["old", "new"])
@pytest.mark.parametrize("rows,t", [(1, 1), (8, 9)])
def test_attention_and_the_pass_grow_with_the_context(design, rows, t):
    costs = [ge.pass_cost(SEVEN_B, rows, t, L, design, A) for L in (512, 2048, 4096, 16384)]
    assert all(a.attention_s < b.attention_s for a, b in pairwise(costs))
    assert all(a.total_s < b.total_s for a, b in pairwise(costs))
    assert len({c.weights_s for c in costs}) == 1  # the weights do not depend on the context


def test_a_costlier_draft_lowers_the_speedup_and_a_costlier_target_raises_it():
    pair = ge.Pair.load(ge.ESTIMATE_PAIR)
    deeper_draft = replace(pair, draft=replace(pair.draft, layers=2 * pair.draft.layers))
    deeper_target = replace(pair, target=replace(pair.target, layers=2 * pair.target.layers))
    for method in [("sd", 1, 4), ("smc", 8, 8)]:
        base = ge.speed(pair, method, NEW, A, 0.9, 512).speedup
        assert ge.speed(deeper_draft, method, NEW, A, 0.9, 512).speedup < base
        assert ge.speed(deeper_target, method, NEW, A, 0.9, 512).speedup > base


def test_sd_gains_with_acceptance_and_smc_does_not_depend_on_it():
    pair = ge.Pair.load(ge.ESTIMATE_PAIR)
    sd = [ge.speed(pair, ("sd", 1, 4), NEW, A, alpha, 512).speedup for alpha in (0.5, 0.8, 1.0)]
    assert sd[0] < sd[1] < sd[2]
    smc = {ge.speed(pair, ("smc", 8, 8), NEW, A, alpha, 512).speedup for alpha in (0.5, 1.0)}
    assert len(smc) == 1


@pytest.mark.parametrize("design,waits", [(OLD, 3), (NEW, 1)], ids=["old", "new"])
def test_the_speed_is_the_roofline_round(design, waits):
    """smc N=8 K=8, its round assembled by hand from the passes: the old design waits for the
    host three times a round (blocking copies of the drafts), the new once."""
    pair = ge.Pair.load(ge.ESTIMATE_PAIR)

    def step(shape, rows, t):
        drawn = ge.sample_s(rows, rows * t, 152064, design, A)
        return ge.pass_cost(shape, rows, t, 512, design, A).total_s + drawn

    ar = step(pair.target, 1, 1) + A.host_wait_s
    round_s = 8 * step(pair.draft, 8, 1) + step(pair.target, 8, 9) + waits * A.host_wait_s
    s = ge.speed(pair, ("smc", 8, 8), design, A, 0.9, 512)
    assert s.round_s == pytest.approx(round_s)
    assert s.speedup == pytest.approx(9 * ar / round_s)
    assert s.tokens_per_s == pytest.approx(9 / round_s)
    # sd K=4: the old design read its 4 accept tests back one by one
    sd = ge.speed(pair, ("sd", 1, 4), design, A, 1.0, 512)
    sd_waits = {"old": 4, "new": 1}[design.name]
    assert sd.round_s == pytest.approx(
        4 * step(pair.draft, 1, 1) + step(pair.target, 1, 5) + sd_waits * A.host_wait_s
    )


def test_a_sampling_call_worked_by_hand():
    # the verify's call: the law over 8 x 9 positions of 152064 float32 logits, 15 passes
    # over them, 8 bonus tokens drawn
    traffic = 15 * 72 * 152064 * 4 / 4.3e12
    assert ge.sample_s(8, 72, 152064, NEW, A) == pytest.approx(49 * 2.5e-6 + 2e-5 + traffic)
    # one float64 scan of each row: 0.15 ms at 8 rows, 0.01 ms for one
    flat = ge.sample_s(8, 72, 152064, OLD, A)
    assert flat == pytest.approx(34 * 2.5e-6 + 1.5e-4 + traffic)
    assert ge.sample_s(1, 1, 152064, OLD, A) == pytest.approx(34 * 2.5e-6 + 1e-5 + traffic / 72)


def test_the_slow_end_is_slower_everywhere():
    slow = ge.slow_end(A)
    assert set(ge.SLOW_END) <= set(ge.SOURCES)
    pair = ge.Pair.load(ge.ESTIMATE_PAIR)
    for design in (OLD, NEW):
        for rows, t in [(1, 1), (8, 9)]:
            fast, late = (
                ge.pass_cost(SEVEN_B, rows, t, 2048, design, x).total_s for x in (A, slow)
            )
            assert late > fast
        for method in ge.METHODS:
            fast, late = (ge.speed(pair, method, design, x, 0.9, 512) for x in (A, slow))
            assert late.tokens_per_s < fast.tokens_per_s


def test_targets_compare_on_the_right_side():
    share = ge.TARGETS[2]  # attention < 15%: strict
    assert share.met(0.149) and not share.met(0.15)
    smc = next(t for t in ge.TARGETS if t.what.startswith("smc"))
    assert smc.met(2.5) and not smc.met(2.49)


def test_bad_assumptions_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        ge.Assumptions(hbm_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="gemm_efficiency"):
        ge.Assumptions(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="pair"):
        ge.Pair.load("no-such-pair")


def test_acceptance_is_pooled_over_the_native_runs(tmp_path):
    runs = [("native", 3, 4), ("native", 5, 6), ("hf", 0, 9)]
    lines = [{"kind": "header"}] + [
        {
            "key": f"k{i}",
            "label": "sd K=4",
            "backend": b,
            "accepted_tokens": a,
            "proposed_tokens": p,
        }
        for i, (b, a, p) in enumerate(runs)
    ]
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert ge.measured_acceptance(path) == pytest.approx(8 / 10)  # not the mean of 0.75, 0.83
    with pytest.raises(ValueError, match="no native"):
        ge.measured_acceptance(path, "sd K=6")


def test_the_script_writes_the_table_every_row_labelled(tmp_path):
    env = {**os.environ, "PYTHONPATH": ""}
    cmd = [sys.executable, str(ROOT / "scripts/gpu_estimate"), "--out", str(tmp_path),
           "--launches-per-layer", "10"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text = (tmp_path / "estimate.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    data = [r for r in rows if not r.startswith(("| label", "| name"))]
    constants = data[-len(ge.SOURCES) :]
    assert all(r.startswith("| ESTIMATE |") for r in data[: -len(ge.SOURCES)])
    assert len(data) - len(constants) == 2 * len(ge.TARGETS) + 6 + 6 + 8
    assert [r.split(" | ")[0][2:] for r in constants] == list(ge.SOURCES)
    assert "benchmarks/cpu/engine-int8/engine.jsonl" in text
    assert "10 a layer + 6, GIVEN (--launches-per-layer)" in text
    assert "launches.count_ops on the meta device, bf16, the plain torch layer" in text
