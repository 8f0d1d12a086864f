"""Property-based tests of the paged cache: random operation sequences against a naive model
where every sequence owns a private, contiguous list of its tokens' K/V."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smcspec.kv.cache import PagedKVCache
from smcspec.kv.pages import OutOfPages, PageAllocator

LAYERS, HEADS, DIM = 2, 1, 3


def test_allocator_counts_and_frees():
    a = PageAllocator(3)
    p = a.allocate()
    table = a.fork([p])
    assert a.refs(p) == 2 and a.free_pages == 2
    a.release(table)
    a.dec_ref(p)
    assert a.free_pages == 3
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_running_out_of_pages_is_a_clean_error():
    cache = PagedKVCache(LAYERS, HEADS, DIM, page_size=2, num_pages=2)
    seq = cache.new_sequence()
    cache.reserve(seq, 4)
    with pytest.raises(OutOfPages):
        cache.reserve(seq, 1)
    assert cache.lengths[seq] == 4  # unchanged by the failed reserve


ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "fork", "assign", "truncate", "release", "forget"]),
        st.integers(0, 10**6),
        st.integers(1, 5),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page_size=st.integers(1, 4))
def test_random_operations_match_a_contiguous_cache(ops, page_size):
    cache = PagedKVCache(LAYERS, HEADS, DIM, page_size=page_size, num_pages=64)
    naive: dict[int, list[torch.Tensor]] = {}  # seq -> per-position K [LAYERS, HEADS, DIM]
    counter = [0.0]

    def fresh(n):
        counter[0] += 1
        return (
            torch.arange(n * LAYERS * HEADS * DIM, dtype=torch.float32).view(n, LAYERS, HEADS, DIM)
            + 1000 * counter[0]
        )

    root = cache.new_sequence()
    naive[root] = []
    for op, pick, n in ops:
        seqs = sorted(naive)
        if not seqs:
            seq = cache.new_sequence()
            naive[seq] = []
            continue
        seq = seqs[pick % len(seqs)]
        if op == "append":
            try:
                slots = cache.reserve(seq, n)
            except OutOfPages:
                continue
            kv = fresh(n)
            for layer in range(LAYERS):
                cache.write(layer, slots, kv[:, layer], -kv[:, layer])
            naive[seq] += list(kv)
        elif op == "fork":
            naive[cache.fork(seq)] = list(naive[seq])
        elif op == "assign":
            ancestors = [seqs[(pick + i * n) % len(seqs)] for i in range(len(seqs))]
            cache.assign(seqs, ancestors)
            snapshot = {s: list(naive[s]) for s in seqs}
            for s, a in zip(seqs, ancestors, strict=True):
                naive[s] = list(snapshot[a])
        elif op == "truncate":
            length = pick % (len(naive[seq]) + 1)
            cache.truncate(seq, length)
            naive[seq] = naive[seq][:length]
        elif op == "release":
            cache.release(seq)
            del naive[seq]
        elif op == "forget":  # the keys below a position freed (a sliding window's past)
            cache.forget_before(seq, pick % (len(naive[seq]) + 1))
        check(cache, naive)
    for seq in list(naive):
        cache.release(seq)
    assert cache.allocator.free_pages == cache.allocator.num_pages  # no page leaks


def check(cache: PagedKVCache, naive: dict) -> None:
    """Every page's count is the tables' references to it (forgotten entries, the scratch page,
    count for none), and every sequence holds its tokens' K/V from its forgotten position on."""
    refs = [0] * cache.allocator.num_pages
    for table in cache.tables.values():
        for page in table:
            if page != cache.scratch_page:
                refs[page] += 1
    assert refs == [cache.allocator.refs(p) for p in range(cache.allocator.num_pages)]
    for seq, tokens in naive.items():
        assert cache.lengths[seq] == len(tokens)
        kept, table, ps = cache.forgotten[seq], cache.tables[seq], cache.page_size
        assert kept <= len(tokens)
        assert all(table[p // ps] != cache.scratch_page for p in range(kept, len(tokens)))
        for layer in range(LAYERS):
            k, v = cache.gather(layer, seq)
            want = torch.stack([t[layer] for t in tokens]) if tokens else k
            torch.testing.assert_close(k[kept:], want[kept:])
            torch.testing.assert_close(v[kept:], -want[kept:])


def test_a_run_touches_only_as_many_pages_as_it_holds_at_once():
    """The page freed last is reused first: a pool's memory is resident only where written, so
    a queue (each free page to the back) made a long run walk the whole pool (the default
    pair's cost profile: 4.4 GB resident, against 3.0 GB). Failed on: a FIFO free list."""
    alloc = PageAllocator(1000)
    touched = set()
    tables: list[list[int]] = []
    for step in range(500):
        tables.append([alloc.allocate() for _ in range(1 + step % 3)])
        touched.update(tables[-1])
        if len(tables) > 4:
            alloc.release(tables.pop(0))
    assert len(touched) == alloc.peak_used <= 15
    last = tables[-1]
    alloc.release(last)
    assert alloc.allocate() == last[-1]  # the page freed last comes back first


def test_forgotten_pages_return_to_the_pool_and_are_never_written():
    """A sliding window's past (`forget_before`): whole pages below the position go back to the
    pool, a partly kept one stays; a fork shares what is left. A rollback into the freed keys
    (a partial last page that was freed) appends into a fresh page, never the scratch page."""
    cache = PagedKVCache(LAYERS, HEADS, DIM, page_size=4, num_pages=8)
    seq = cache.new_sequence()
    cache.reserve(seq, 14)  # pages 0-3, the last one half full
    cache.forget_before(seq, 9)  # positions 0-7 (pages 0 and 1) freed, 8 still needed
    assert cache.allocator.used_pages == 2 and cache.forgotten[seq] == 8
    child = cache.fork(seq)
    assert cache.allocator.used_pages == 2
    cache.truncate(seq, 6)  # into the freed keys: nothing below 6 is left
    assert cache.forgotten[seq] == 6 and cache.allocator.used_pages == 2
    slots = cache.reserve(seq, 3)  # positions 6-8: a fresh page for 6-7, another for 8
    assert (slots // 4 != cache.scratch_page).all()
    assert cache.scratch_page not in cache.tables[seq][1:]
    for s in (seq, child):
        cache.release(s)
    assert cache.allocator.free_pages == 8
