"""The native engine's KV pools sized from `EngineLimits`: a page count as given, or a share of
the free memory split so both pools (and their scratch pages) fit in it; a size that cannot hold
one sequence of the model's context refused before anything is allocated.

The tiny model has 2 layers and 2 KV heads of 8 dims: K and V of one position are 2 x 2 x 2 x 8
= 64 numbers, 256 bytes in float32 and 128 in bfloat16, so a 16-position page costs 4,096 bytes
(2,048), and one page in each of two such pools 8,192 (4,096). Those numbers are written here,
not computed by the code under test; the pools' own tensors are measured too."""

import pytest
import torch

from smcspec.config import DEFAULT_KV_PAGES, EngineLimits
from smcspec.kv.pages import OutOfPages
from smcspec.models import native
from smcspec.models.llama import LlamaModel

MiB = 2**20


@pytest.fixture(scope="module")
def models(tiny_llama_folder, tiny_llama_draft_folder):
    return {
        dtype: [
            LlamaModel.from_folder(f, dtype) for f in (tiny_llama_folder, tiny_llama_draft_folder)
        ]
        for dtype in ("float32", "bfloat16")
    }


def pool_bytes(lm: native.NativeCausalLM) -> int:
    """What the pool's tensors hold, scratch page included."""
    return lm.kv.k.nbytes + lm.kv.v.nbytes


def free(monkeypatch, nbytes: int) -> list[torch.device]:
    """Make the device report `nbytes` free; returns the devices asked about."""
    asked = []

    def probe(device):
        asked.append(device)
        return nbytes

    monkeypatch.setattr(native, "free_bytes", probe)
    return asked


def test_a_page_costs_what_the_pool_tensors_hold(models):
    """Failed on: page_bytes counting K only (2,048 bytes for float32)."""
    for dtype, per_page in (("float32", 4096), ("bfloat16", 2048)):
        model = models[dtype][0]
        assert native.page_bytes(model, 16) == per_page
        assert model.new_kv(1, 16).bytes_per_token * 16 == per_page


def test_kv_memory_shares_the_free_memory_between_both_pools(models, monkeypatch):
    """Half of 1 MiB over 8,192 bytes a page (both pools) is 64 pages, less the scratch page
    each pool holds: 63. Both pools together fit the half; one page more each would not.
    Failed on: no scratch page taken off (64 pages, 8 KiB over); one model's page cost only
    (127 pages)."""
    asked = free(monkeypatch, MiB)
    pair = [(m, {1}) for m in models["float32"]]
    target, draft = native.build(pair, EngineLimits(kv_memory=0.5), graphs=False)
    assert asked == [torch.device("cpu")]
    assert target.pages.num_pages == draft.pages.num_pages == 63
    used = pool_bytes(target) + pool_bytes(draft)
    assert used <= MiB // 2 < used + 2 * 4096


def test_kv_memory_counts_the_cache_dtype(models, monkeypatch):
    """bfloat16 halves a page: the same share holds twice the pages (128 - 1). Failed on:
    page_bytes with 4 bytes per number whatever the dtype (63 pages)."""
    free(monkeypatch, MiB)
    assert native.pool_pages(models["bfloat16"], EngineLimits(kv_memory=0.5)) == 127


def test_kv_pages_is_taken_as_given_with_its_page_size(models):
    """Failed on: build ignoring limits.page_size (pages of the default 16)."""
    pair = [(m, {1}) for m in models["float32"]]
    target, draft = native.build(pair, EngineLimits(kv_pages=40, page_size=4), graphs=False)
    for lm in (target, draft):
        assert lm.pages.num_pages == 40 and lm.page_size == 4 == lm.kv.page_size


def test_no_size_keeps_the_default_pool_and_probes_nothing(models, monkeypatch):
    def probe(device):
        raise AssertionError("the free memory is read only for kv_memory")

    monkeypatch.setattr(native, "free_bytes", probe)
    assert native.pool_pages(models["float32"], EngineLimits()) == DEFAULT_KV_PAGES == 4096


@pytest.mark.parametrize(
    ("limits", "room", "flag"),
    [
        (EngineLimits(kv_pages=7), None, "--kv-pages"),  # 112 positions < 128
        (EngineLimits(kv_pages=31, page_size=4), None, "--kv-pages"),  # 124 < 128
        (EngineLimits(kv_memory=0.5), 8 * 8192, "--kv-memory"),  # 4 pages - 1 scratch
    ],
)
def test_a_pool_shorter_than_the_context_is_refused_before_allocating(
    models, monkeypatch, limits, room, flag
):
    """The tiny context is 128 positions. Failed on: the check removed (the spy sees the pools
    allocated)."""
    free(monkeypatch, room or 0)

    def allocate(*args, **kwargs):
        raise AssertionError("allocated before the check")

    monkeypatch.setattr(LlamaModel, "new_kv", allocate)
    pair = [(m, {1}) for m in models["float32"]]
    with pytest.raises(ValueError, match=f"context \\(128 positions.*raise {flag}"):
        native.build(pair, limits, graphs=False)


def test_a_pool_of_exactly_the_context_is_taken(models):
    """8 pages x 16 = 128 positions. Failed on: `<=` for `<` in the check."""
    assert native.pool_pages(models["float32"], EngineLimits(kv_pages=8)) == 8
    assert native.pool_pages(models["float32"], EngineLimits(kv_pages=32, page_size=4)) == 32


def test_the_free_ram_is_what_the_system_reports_available():
    """Failed on: MemAvailable read as bytes (it is in kB); MemFree read instead (on a machine
    with a page cache it is far less)."""
    psutil = pytest.importorskip("psutil")
    memory = psutil.virtual_memory()
    got = native.free_bytes(torch.device("cpu"))
    assert abs(got - memory.available) < 0.05 * memory.total


def test_running_out_of_pages_mid_decode_names_the_pool_and_the_flag(models):
    """A decode outside the scheduler (`generate`) has no admission check: the pool running
    dry says how big it is and what grows it. Failed on: the bare allocator error."""
    lm = native.NativeCausalLM(models["float32"][0], {1}, num_pages=2, page_size=4, graphs=False)
    cache = lm.new_cache()
    with pytest.raises(OutOfPages, match=r"\(2 pages x 4 positions\).*--kv-pages or --kv-memory"):
        lm.forward(torch.full((1, 9), 3), cache, 1)  # 9 positions: 3 pages
