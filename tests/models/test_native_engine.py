"""The native engine's device-independent parts, on the CPU: attention implementations against
each other through the whole model, the CUDA-graph runner's logic with its eager stand-in, the
paged-model protocol, and a hot path without host tensors or host syncs (the meta device)."""

import os

import pytest
import torch

from smcspec.engine import LLM
from smcspec.models import graphs, paged_attention
from smcspec.models.base import PagedModel
from smcspec.models.graphs import GraphRunner, eager_capture
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights
from smcspec.models.native import NativeCausalLM
from smcspec.models.toy import random_lm

if not torch.cuda.is_available():  # Triton's interpreter runs the kernel on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

CONFIG = LlamaConfig.from_hf(
    {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
)


def model(attention: str) -> LlamaModel:
    weights = random_weights(CONFIG, "cpu", seed=3)
    for name, w in weights.items():  # larger than N(0, 0.02): logits that differ visibly
        weights[name] = w * 10 if "norm" not in name else w
    return LlamaModel(CONFIG, weights, "float32", "cpu", attention)


def script(lm: NativeCausalLM) -> list[torch.Tensor]:
    """Logits of a fixed run of cache operations: a prefill of 3 rows, decode steps, a verify of
    4 tokens a row, resampling (rows repeated), rollback; then the cache is released."""
    g = torch.Generator().manual_seed(0)
    cache = lm.new_cache()
    out = [lm.forward(torch.randint(0, 64, (1, 20), generator=g), cache, 1)]  # prefill: gather
    out.append(lm.forward(torch.randint(0, 64, (1, 9), generator=g), cache, 9))
    cache.select(torch.tensor([0, 0, 0]))
    for t in (1, 1, 4, 1):
        out.append(lm.forward(torch.randint(0, 64, (3, t), generator=g), cache, t))
    cache.select(torch.tensor([2, 0, 2]))  # resampling: rows share pages
    cache.crop(cache.length - 2)  # speculative rollback into a shared page
    for t in (4, 1):
        out.append(lm.forward(torch.randint(0, 64, (3, t), generator=g), cache, t))
    cache.release()
    assert lm.pages.used_pages == 0
    return out


def kernels() -> list[str]:
    return ["reference"] + (["triton"] if paged_attention.triton_available("cpu") else [])


@pytest.mark.parametrize("attention", kernels())
def test_paged_attention_gives_the_gather_paths_logits(attention):
    expected = script(NativeCausalLM(model("gather"), {0}, 64, 4, graphs=False))
    got = script(NativeCausalLM(model(attention), {0}, 64, 4, graphs=False))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_long_feeds_take_the_gather_path():
    """Prefills go through SDPA even where the paged kernel is the default; steps stay paged."""
    m = model("reference")
    kv = m.new_kv(16, 4)
    seq = kv.new_sequence()
    assert m.plan(kv, [seq], [17]).attention.name == "gather"
    assert m.plan(kv, [seq], [16]).attention.name == "paged-reference"


def test_graphs_give_the_eager_logits_with_padding_to_buckets():
    eager = NativeCausalLM(model("reference"), {0}, 64, 4, graphs=False)
    graphed = NativeCausalLM(model("reference"), {0}, 64, 4, capture=eager_capture)
    expected, got = script(eager), script(graphed)
    # float32 rounding only: a padded batch of 4 rows runs other matmul blocks than 3 rows
    # (up to 1.8e-6 apart on an AVX-512 CPU), where a padding row writing into a live page
    # moves logits by more than 1e-3 (the test below)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    runner = graphed.graphs
    assert eager.graphs is None and runner is not None
    # every bucket captured when the model was built (a steps graph each, a verify graph from 3
    # tokens); 3 rows of 1 token run in the bucket of 4 (one padding row), of 4 tokens in the
    # bucket of 16; only the 20-token prefill is eager
    verify_buckets = [b for b in graphs.TOKEN_BUCKETS if b > graphs.STEP_TOKENS]
    assert runner.captures == len(graphs.TOKEN_BUCKETS) + len(verify_buckets)
    assert runner.replays == len(got) - 1


def test_padding_rows_that_wrote_to_a_live_page_would_be_caught(monkeypatch):
    """Power: the comparison above fails when the graphs' padding rows write their keys into a
    page a real sequence holds instead of the scratch page."""
    expected = script(NativeCausalLM(model("reference"), {0}, 64, 4, graphs=False))
    graphed = NativeCausalLM(model("reference"), {0}, 64, 4, capture=eager_capture)
    monkeypatch.setattr(graphed.kv, "scratch_page", 0)  # page 0 holds the prompt's first keys
    got = script(graphed)
    assert max((a - b).abs().max() for a, b in zip(got, expected, strict=True)) > 1e-3


def test_the_runner_leaves_prefills_too_many_tokens_and_too_long_sequences_to_the_eager_path():
    lm = NativeCausalLM(model("reference"), {0}, 64, 4, graphs=False)
    runner = GraphRunner(lm.model, lm.kv, context_length=16, capture=eager_capture, buckets=(2, 4))
    runner.capture_all()
    seqs = [lm.kv.new_sequence() for _ in range(3)]
    assert runner.run(seqs, [torch.tensor([5, 6])] * 3, [1, 1, 1]) is None  # 6 tokens > 4
    assert runner.run(seqs[:1], [torch.tensor(range(17))], [1]) is None  # a row > 16: a prefill
    rows = runner.run(seqs[:2], [torch.tensor([5]), torch.tensor([5, 6])], [1, 2])  # ragged
    assert rows is not None and [r.shape for r in rows] == [(1, 64), (2, 64)]
    lm.kv.truncate(seqs[0], 0)
    lm.kv.reserve(seqs[0], 15)  # 15 + 2 positions > the 16 of the graphs' page tables
    assert runner.run(seqs[:1], [torch.tensor([5, 6])], [1]) is None
    # buckets 2 and 4 of steps, 4 of verifies
    assert runner.replays == 1 and runner.captures == 3 and lm.pages.used_pages > 0
    for s in seqs:
        lm.kv.release(s)
    assert lm.pages.used_pages == 0


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_graphs_give_the_same_tokens_for_a_seed(method):
    """Graphs against eager through the decoders: identical tokens for a fixed seed."""

    def llm(**kw):
        target = NativeCausalLM(model("reference"), {0}, 128, 4, **kw)
        draft = NativeCausalLM(model("reference"), {0}, 128, 4, **kw)  # same weights: a close draft
        return LLM.from_models(target, draft)

    settings = dict(particles=3, draft_tokens=3, max_new_tokens=12, stop_at_eos=False, seed=5)
    if method != "smc":
        settings.pop("particles")
    if method == "ar":
        settings.pop("draft_tokens")
    graphed = llm(capture=eager_capture)
    a = llm(graphs=False).generate([1, 2, 3, 4], method, **settings)
    b = graphed.generate([1, 2, 3, 4], method, **settings)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert graphed.target.graphs.replays > 0
    assert graphed.target.pages.used_pages == 0 and graphed.draft.pages.used_pages == 0


def test_the_hot_path_makes_no_host_tensor_and_no_host_sync():
    """On the meta device a host tensor mixed into the arithmetic raises, and so does reading
    a value back (int(), .item(), `if t.any()`): a forward that runs there, from planning to
    logits, makes every tensor on the model's device and never waits for it."""
    weights = random_weights(CONFIG, "cpu")
    lm = NativeCausalLM(LlamaModel(CONFIG, weights, "float32", "meta", "gather"), {0}, 16, 4)
    cache = lm.new_cache()
    out = lm.forward(torch.tensor([[1, 2, 3]]), cache, 2)
    cache.select(torch.tensor([0, 0]))
    step = lm.forward(torch.tensor([[4, 5], [6, 7]]), cache, 2)
    assert out.device.type == step.device.type == "meta"
    assert out.shape == (1, 2, 64) and step.shape == (2, 2, 64)
    # the scheduler batches a request's sampled tokens (on the device) with another's prompt
    fresh = lm.new_cache()
    sampled = torch.tensor([[8], [9]], device="meta")
    both = lm.forward_many([(sampled, cache, 1), (torch.tensor([[1, 2, 3]]), fresh, 1)])
    assert [x.shape for x in both] == [(2, 1, 64), (1, 1, 64)]
    with pytest.raises(RuntimeError):  # the test has teeth: a read-back fails there
        int(step.sum())


def test_graphs_pin_the_rope_table_they_read():
    """Captured graphs read the RoPE table in place: it is made for the whole context first and
    a longer sequence is refused (before any page is reserved) rather than moving it."""
    lm = NativeCausalLM(model("reference"), {0}, 64, 4, capture=eager_capture)
    table = lm.model.rope.cos
    assert table.shape[0] >= 128
    cache = lm.new_cache()
    with pytest.raises(ValueError, match="context length"):
        lm.forward(torch.zeros(1, table.shape[0] + 1, dtype=torch.long), cache, 1)
    assert lm.model.rope.cos is table and lm.pages.used_pages == 0


def test_the_paged_model_protocol():
    lm = NativeCausalLM(model("gather"), {0}, 16, 4)
    assert isinstance(lm, PagedModel) and lm.page_size == 4 and lm.context_length == 128
    assert not isinstance(random_lm(8, seed=0), PagedModel)
    assert lm.kv.scratch_page == 16 and lm.pages.num_pages == 16  # the scratch page is extra
