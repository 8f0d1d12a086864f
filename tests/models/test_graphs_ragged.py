"""CUDA graphs keyed by total-token buckets: the scheduler's mixed passes replay them, their
padding stays in the scratch page, their logits are the eager ones, and every capture happens
when the model is built. On the CPU through `eager_capture` and the paged reference; on a CUDA
machine the same tests run again with captured CUDA graphs over the Triton kernel (float32,
whose dots keep float32's accuracy: `paged_attention._precision`), pinned staging included."""

import pytest
import torch

from smcspec.engine import LLM
from smcspec.engine.scheduler import Scheduler
from smcspec.models import graphs, paged_attention
from smcspec.models.graphs import CudaCapture, GraphRunner, eager_capture
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights
from smcspec.models.native import NativeCausalLM

CONFIG = LlamaConfig.from_hf(
    {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 64,  # head_dim 16: the Triton kernel's smallest
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    if request.param == "cuda" and not (
        torch.cuda.is_available() and paged_attention.triton_available("cuda")
    ):
        pytest.skip("needs a CUDA GPU with Triton: captured CUDA graphs")
    return request.param


def model(device: str, attention: str | None = None) -> LlamaModel:
    """`attention` None: the device's graph attention (Triton on CUDA, the paged reference on
    the CPU)."""
    weights = random_weights(CONFIG, "cpu", seed=3)
    for name, w in weights.items():  # larger than N(0, 0.02): logits that differ visibly
        weights[name] = w * 10 if "norm" not in name else w
    attention = attention or ("triton" if device == "cuda" else "reference")
    return LlamaModel(CONFIG, weights, "float32", device, attention)


class CountingCapture:
    """The device's capture (CUDA graphs, or `eager_capture` on the CPU), counting its calls."""

    def __init__(self, device: str) -> None:
        self.inner = CudaCapture() if device == "cuda" else eager_capture
        self.calls = 0

    def __call__(self, fn):
        self.calls += 1
        return self.inner(fn)


def native(
    device: str, pages: int, graphs_on: bool = True, attention: str | None = None, **kw
) -> NativeCausalLM:
    if graphs_on:
        kw.setdefault("capture", CountingCapture(device))
    else:
        kw["graphs"] = False
    lm = model(device, attention)
    return NativeCausalLM(lm, {0}, pages, 4, graph_buckets=BUCKETS, **kw)


def pair(device: str, graphs_on: bool = True, **kw) -> LLM:
    target = native(device, 256, graphs_on, **kw)
    draft = native(device, 256, graphs_on, **kw)  # the same weights: a close draft
    return LLM.from_models(target, draft)


# Two smc and two sd requests at once: one pass mixes a first draft step (2 tokens a row) with
# later ones (1), verifies of K + 1 = 3, 4 and 5 tokens, and prompts of 3 to 20 tokens.
REQUESTS = [
    ([1, 2, 3], "smc", dict(particles=3, draft_tokens=3)),
    ([4, 5, 6, 7, 8], "smc", dict(particles=2, draft_tokens=4)),
    (list(range(9, 29)), "sd", dict(draft_tokens=2)),  # 20 tokens: an eager prefill
    ([30, 31], "sd", dict(draft_tokens=3)),
]


def serve(llm: LLM) -> tuple[list[list[int]], Scheduler]:
    """The requests through one scheduler, as `LLM.generate_batch` runs them."""
    scheduler = Scheduler((llm.target, llm.draft))
    try:
        jobs = [
            scheduler.submit(
                llm.job(llm.request(p, m, max_new_tokens=10, stop_at_eos=False, seed=i, **kw))
            )
            for i, (p, m, kw) in enumerate(REQUESTS)
        ]
        return [job.future.result().token_ids for job in jobs], scheduler
    finally:
        scheduler.shutdown()


def test_concurrent_smc_and_sd_requests_replay_graphs_with_the_eager_tokens(device):
    """Every pass whose rows each feed <= MAX_TOKENS_PER_ROW tokens (steps of any mix, prompts
    up to 16 tokens) is decode-like, and all of this run's fit the largest bucket (at most
    3 * 4 + 2 * 5 + 4 + 5 = 31 tokens <= 64). The only other passes are the 20-token prompt's
    prefill, one per model (the scheduler's 256-token room takes it whole): so at least
    passes - 2 of them replay."""
    expected, _ = serve(pair(device, graphs_on=False))
    got, scheduler = serve(pair(device))
    assert got == expected and all(len(t) == 10 for t in got)
    passes, replays = sum(scheduler.stats.forwards), sum(scheduler.stats.replays)
    print(f"{replays} of {passes} passes replayed")
    assert replays >= passes - 2
    assert replays < passes  # and the prefill ran eagerly in the same run


def test_no_capture_happens_after_start_up(device):
    spy = CountingCapture(device)
    llm = pair(device, capture=spy)
    # every bucket's steps graph and, from 3 tokens, its verify graph, of both models, when
    # they were built
    graphs_per_model = len(BUCKETS) + sum(b > graphs.STEP_TOKENS for b in BUCKETS)
    assert spy.calls == 2 * graphs_per_model == 2 * 12
    out = llm.generate([1, 2, 3], "smc", particles=3, draft_tokens=3, max_new_tokens=6, seed=1)
    assert len(out.token_ids) > 0 and llm.target.graph_replays > 0
    assert spy.calls == 2 * graphs_per_model


def twin_batches(
    device: str, attention: str | None = None
) -> tuple[NativeCausalLM, NativeCausalLM, list[list[int]]]:
    """Two models with the same weights and the same four sequences (prefixes of 5, 0, 9 and
    3 positions), one with graphs, one without."""
    lms = []
    for graphs_on in (True, False):
        lm = native(device, 64, graphs_on, attention)
        seqs = [lm.kv.new_sequence() for _ in range(4)]
        g = torch.Generator().manual_seed(0)
        prefixes = [torch.randint(1, 64, (n,), generator=g) for n in (5, 0, 9, 3)]
        live = [(s, p) for s, p in zip(seqs, prefixes, strict=True) if p.numel()]
        lm.model.forward_ragged(lm.kv, [s for s, _ in live], [p for _, p in live], [1] * 3)
        lms.append((lm, seqs))
    (graphed, seqs), (eager, twin) = lms
    return graphed, eager, [seqs, twin]


def test_a_pass_mixing_token_counts_replays_one_graph_with_the_eager_logits(device):
    check_a_mixed_pass(device)


def test_the_interpreted_triton_kernel_reads_the_padded_batch():
    """The kernel that graphs run on a GPU finds each sequence's tokens through query_starts
    (the reference reads seq_index): the padded layout, zero-length rows included, through it."""
    if not paged_attention.triton_available("cpu"):
        pytest.skip("needs Triton (its interpreter runs the kernel on the CPU)")
    check_a_mixed_pass("cpu", "triton")


def check_a_mixed_pass(device: str, attention: str | None = None) -> None:
    graphed, eager, (seqs, twin) = twin_batches(device, attention)
    g = torch.Generator().manual_seed(1)
    feeds = [torch.randint(1, 64, (t,), generator=g) for t in (1, 2, 5, 3)]  # 11 -> bucket 16
    wants = [1, 1, 5, 2]
    got = graphed.graphs.run(seqs, feeds, wants)
    expected = eager.model.forward_ragged(eager.kv, twin, feeds, wants)
    assert got is not None and graphed.graphs.replays == 1
    assert [r.shape[0] for r in got] == wants
    # float32 rounding only: a padded batch runs other matmul blocks (1.8e-6 apart on this
    # CPU's AVX-512), and on a GPU other cuBLAS kernels and attention splits too, each a
    # reordered float32 sum (~1e-6 relative over these widths): 1e-4 there. A logit row off by
    # one, a wrong position or a padding key in a live page moves logits by > 0.9 (measured).
    tol = 1e-4 if device == "cuda" else 1e-5
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # what a sequence-packed kernel reads: each token inside its own row's query_starts range
    s = graphed.graphs._static
    qs, rows = s.query_starts[:17].tolist(), s.seq_index[:16].tolist()
    assert qs[0] == 0 and qs[-1] == 16 and qs == sorted(qs)
    assert all(qs[r] <= i < qs[r + 1] for i, r in enumerate(rows))
    assert qs[1:5] == [1, 3, 8, 11]  # the batch's rows, then one padding token a row


def test_padding_tokens_write_only_the_scratch_page(device):
    """Five live tokens in the bucket of 8: three padding tokens run beside them, and the pool
    outside the scratch page changes at the live tokens' slots alone."""
    graphed, _, (seqs, _) = twin_batches(device)
    kv = graphed.kv
    before_k, before_v = kv.k.clone(), kv.v.clone()
    seq, start = seqs[0], kv.lengths[seqs[0]]
    assert graphed.graphs.run([seq], [torch.tensor([7, 8, 9, 10, 11])], [1]) is not None
    live = [divmod(p, kv.page_size) for p in range(start, start + 5)]
    live = [(kv.tables[seq][column], offset) for column, offset in live]
    for after, before in ((kv.k, before_k), (kv.v, before_v)):
        changed = (after != before).flatten(3).any(-1)  # [layers, pages, page_size]
        changed[:, kv.scratch_page] = False
        for page, offset in live:
            assert changed[:, page, offset].all()  # the live tokens' own keys and values
            changed[:, page, offset] = False
        assert not changed.any(), changed.nonzero()[:5]
    assert (kv.k[:, kv.scratch_page] != before_k[:, kv.scratch_page]).any()  # padding ran


def test_steps_that_never_wait_for_the_device_give_the_eager_tokens(device):
    """Twelve greedy steps of 3 rows, 1 or 2 tokens a row, each picked on the device, read back
    once at the end: on CUDA the host lays a pass out while the device may still run the one
    before, in the (pinned) staging buffers the last load copied from."""
    runs = []
    for graphs_on in (True, False):
        lm = native(device, 64, graphs_on)
        cache = lm.new_cache()
        prompt = torch.arange(1, 13).view(3, 4)  # 12 tokens: a graph's pass too
        logits = lm.forward(prompt, cache, 1)  # [3, 1, V]
        picked = []
        for step in range(12):
            token = logits[:, -1].argmax(-1, keepdim=True)  # [3, 1] on the device
            feed = token if step % 3 else torch.cat([token, (token + 1) % 64], dim=1)
            picked.append(feed)
            logits = lm.forward(feed, cache, feed.shape[1])
        runs.append(torch.cat(picked, dim=1).tolist())
        if graphs_on:
            assert lm.graph_replays == 13
            assert lm.graphs._host.slots.is_pinned() == (device == "cuda")
    assert runs[0] == runs[1]


def test_buckets_must_be_increasing_positive_counts():
    lm = native("cpu", 16, graphs_on=False)
    for bad in ((), (0, 4), (4, 2), (2, 2)):
        try:
            GraphRunner(lm.model, lm.kv, 16, eager_capture, bad)
        except ValueError as err:
            assert "graph buckets" in str(err)
        else:
            raise AssertionError(f"buckets {bad} accepted")
    assert graphs.TOKEN_BUCKETS[-1] >= 256  # the scheduler's default pass fits a bucket


def test_int8_models_leave_position_0_to_the_eager_path():
    """int8 models compute a sequence's first position apart (its attention sink), which a
    graph's plain layers would not: a prompt runs eagerly, the steps after it replay."""
    runs = []
    for graphs_on in (True, False):
        weights = random_weights(CONFIG, "cpu", seed=3)
        lm = LlamaModel(CONFIG, weights, "int8", "cpu", "reference")
        kw = {"capture": eager_capture} if graphs_on else {"graphs": False}
        engine = NativeCausalLM(lm, {0}, 16, 4, graph_buckets=BUCKETS, **kw)
        cache = engine.new_cache()
        runs.append([engine.forward(torch.tensor([[3, 4, 5]]), cache, 3)])
        runs[-1].append(engine.forward(torch.tensor([[6, 7]]), cache, 2))
        if graphs_on:
            assert engine.graph_replays == 1
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Planned(Exception):
    """Raised by the plan spy below with the launch planned: the pass stops there."""


def test_a_graphed_verify_gets_the_eager_wide_tile_and_a_draft_step_the_narrow_one(monkeypatch):
    """The attention tile a pass gets (paged_attention.plan) follows its longest row, which a
    graph's padding rows must not hide, nor a verify's draft steps beside it in a scheduler's
    pass: an 8 x 9 verify padded to 96 rows of one token, and one verify of 9 among 7 draft
    steps of 1, plan the eager verify's wide tile (each sequence's keys read once per kv head);
    a draft step (rows of 1 or 2 tokens) keeps the narrow one. Only the plan is wanted: the spy
    stops the pass at the first layer's attention, before any kernel runs. bfloat16: float32
    is always narrow."""
    if not paged_attention.triton_available("cpu"):
        pytest.skip("needs Triton (its interpreter runs the kernel on the CPU)")
    plan = paged_attention.plan

    def spy(*args, **kwargs) -> paged_attention.Launch:
        raise Planned(plan(*args, **kwargs))

    monkeypatch.setattr(paged_attention, "plan", spy)
    lm = LlamaModel(CONFIG, random_weights(CONFIG, "cpu", seed=3), "bfloat16", "cpu", "triton")
    engine = NativeCausalLM(lm, {0}, 64, 4, capture=eager_capture)  # graphs.TOKEN_BUCKETS
    kv, seqs = engine.kv, [engine.kv.new_sequence() for _ in range(8)]

    def planned(forward, feeds: list[torch.Tensor]) -> paged_attention.Launch:
        for s in seqs:  # a prefix of 5 keys (what they hold does not matter to the plan)
            kv.truncate(s, 0)
            kv.reserve(s, 5)
        with pytest.raises(Planned) as stopped:
            forward(seqs, feeds, [1] * len(feeds))
        return stopped.value.args[0]

    verify = [torch.arange(1, 10)] * 8
    mixed = verify[:1] + [torch.tensor([5])] * 7
    step = [torch.tensor([5, 6])] + [torch.tensor([5])] * 7
    feeds = (verify, mixed, step)  # graphs' buckets 96, 16, 16
    eager = [planned(lambda *a: lm.forward_ragged(kv, *a), f) for f in feeds]
    graphed = [planned(engine.graphs.run, f) for f in feeds]
    tiles = [[(x.block_q, x.block_m) for x in launches] for launches in (graphed, eager)]
    wide, narrow = (32, 64), (8, 16)  # GROUP 2: 9 tokens x 2 heads > 16 rows, 2 x 2 <= 16
    assert tiles[0] == tiles[1] == [wide, wide, narrow], tiles
    assert graphed[0].grid[0] == 96 // 32 + 96  # the bucket of 96 rows, its q-blocks of 32
