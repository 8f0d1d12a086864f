"""The weight cache (int8 and int4): a model is quantized once; later loads read the quantized
weights back and give the very same logits; a changed source or a half-written cache is never
trusted."""

import json
import os
import shutil

import pytest
import torch

from smcspec.models import cpu_linear, weight_cache
from smcspec.models.layers import AtenInt4Linear, Int8Linear, cache_kind
from smcspec.models.llama import LlamaModel
from tests.conftest import save_tiny_model

IDS = [5, 9, 3, 17, 4, 40, 2]
INT8 = cache_kind("int8")  # "int8-b16-g128" on smcspec's kernel, "int8" on fbgemm


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tiny"
    save_tiny_model(path, seed=3, arch="llama")
    return path


def logits(model: LlamaModel) -> torch.Tensor:
    kv = model.new_kv(4, 16)
    seq = kv.new_sequence()
    return model.forward(kv, [seq], [torch.tensor(IDS)], len(IDS))


def cache_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("smcspec-int8"))


def builds_from_cache(monkeypatch) -> list[bool]:
    """From now on, whether each model built was given cached quantized weights."""
    made: list[bool] = []
    real = LlamaModel.__init__

    def spy(self, *args, quantized=None, **kw):
        made.append(quantized is not None)
        real(self, *args, quantized=quantized, **kw)

    monkeypatch.setattr(LlamaModel, "__init__", spy)
    return made


def test_the_first_load_writes_the_cache_and_the_next_reads_it(folder, monkeypatch):
    cold = LlamaModel.from_folder(folder, "int8")
    assert cache_files(folder) == [f"smcspec-{INT8}.json", f"smcspec-{INT8}.safetensors"]
    made = builds_from_cache(monkeypatch)
    warm = LlamaModel.from_folder(folder, "int8")
    assert made == [True]  # built from the cache, not quantized again
    assert torch.equal(logits(warm), logits(cold))


def test_weights_are_quantized_from_the_source_not_the_cache(folder):
    """The cache holds what quantizing gives: an int8 model built without it agrees."""
    cold = LlamaModel.from_folder(folder, "int8")
    cached = weight_cache.load(folder, INT8)
    keys = ("q8", "scales") if cpu_linear.runs_int8() else ("q", "scale")
    assert cached is not None and f"model.layers.0.self_attn.qkv.{keys[0]}" in cached
    for key, tensor in zip(keys, cold.layers[0].qkv.quantized(), strict=True):
        assert torch.equal(cached[f"model.layers.0.self_attn.qkv.{key}"], tensor)


def test_a_changed_source_rebuilds_the_cache(folder):
    LlamaModel.from_folder(folder, "int8")
    source = folder / "model.safetensors"
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert weight_cache.load(folder, INT8) is None  # the stamp no longer matches
    LlamaModel.from_folder(folder, "int8")
    assert weight_cache.load(folder, INT8) is not None


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The source files the cache reads whole (to take their SHA-256), from now on."""
    seen = []
    real = weight_cache._sha256

    def spy(path):
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(weight_cache, "_sha256", spy)
    return seen


def test_a_size_change_that_keeps_the_mtime_rebuilds_without_hashing(folder, hashed):
    LlamaModel.from_folder(folder, "int8")
    source = folder / "model.safetensors"
    before = source.stat()
    with open(source, "ab") as f:
        f.write(bytes(8))
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    hashed.clear()
    assert weight_cache.load(folder, INT8) is None
    assert hashed == [], "a size change is decided from the metadata alone"


def test_a_cache_of_another_format_is_rebuilt(folder):
    LlamaModel.from_folder(folder, "int8")
    stamp_file = folder / f"smcspec-{INT8}.json"
    saved = json.loads(stamp_file.read_text())
    for version in (weight_cache.FORMAT - 1, weight_cache.FORMAT + 1):
        stamp_file.write_text(json.dumps({**saved, "format": version}))
        assert weight_cache.load(folder, INT8) is None, version


def test_a_same_size_replacement_with_the_same_mtime_is_found_by_its_sha256(
    folder, tmp_path, hashed
):
    """`cp -p` of other weights of the same shapes and modification time: only the change time
    tells, and the SHA-256 then shows other bytes."""
    LlamaModel.from_folder(folder, "int8")
    source = folder / "model.safetensors"
    other = tmp_path / "other"
    save_tiny_model(other, seed=4, arch="llama")
    replacement = other / "model.safetensors"
    before = source.stat()
    assert replacement.stat().st_size == before.st_size
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    shutil.copy2(replacement, source)  # cp -p
    after = source.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns
    hashed.clear()
    assert weight_cache.load(folder, INT8) is None
    assert hashed == [source.name]
    replaced = LlamaModel.from_folder(folder, "int8")
    assert torch.equal(logits(replaced), logits(LlamaModel.from_folder(other, "int8")))


def test_the_same_bytes_in_a_new_file_keep_the_cache_and_are_hashed_once(folder, hashed):
    cold = LlamaModel.from_folder(folder, "int8")
    source = folder / "model.safetensors"
    hashed.clear()
    assert weight_cache.load(folder, INT8) is not None
    assert hashed == [], "a warm load reads no source file whole"
    copy = folder / "copy"
    shutil.copy2(source, copy)
    os.replace(copy, source)  # a new inode: the bytes, size and mtime are the same
    assert weight_cache.load(folder, INT8) is not None
    assert weight_cache.load(folder, INT8) is not None
    assert hashed == [source.name], "the stamp takes the new inode after one hash"
    assert torch.equal(logits(LlamaModel.from_folder(folder, "int8")), logits(cold))


def test_a_cache_without_its_stamp_is_ignored(folder):
    LlamaModel.from_folder(folder, "int8")
    (folder / f"smcspec-{INT8}.json").unlink()  # as if the write stopped before the stamp
    assert weight_cache.load(folder, INT8) is None
    (folder / f"smcspec-{INT8}.json").write_text("{not json")
    assert weight_cache.load(folder, INT8) is None


def test_a_read_only_model_folder_caches_under_the_cache_root(folder, tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root writes anywhere: check the choice of place instead
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    else:
        folder.chmod(0o555)
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    try:
        cold = LlamaModel.from_folder(folder, "int8")
        assert cache_files(folder) == []
        where = weight_cache.location(folder, INT8)
        assert where.parent.parent == tmp_path / "cache" / INT8
        assert where.with_suffix(".safetensors").is_file()
        assert torch.equal(logits(LlamaModel.from_folder(folder, "int8")), logits(cold))
    finally:
        folder.chmod(0o755)
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_float_models_neither_read_nor_write_it(folder):
    LlamaModel.from_folder(folder, "float32")
    assert cache_files(folder) == []


def test_two_writers_at_once_leave_one_whole_cache(folder):
    """Two processes loading the same model for the first time both build the cache: each
    writes its own file and replaces the target with it, so the result is whole."""
    from concurrent.futures import ThreadPoolExecutor

    int8 = LlamaModel.from_folder(folder, "int8")
    (folder / f"smcspec-{INT8}.json").unlink()
    with ThreadPoolExecutor(2) as pool:
        done = list(
            pool.map(lambda _: weight_cache.save(folder, int8.quantized_entries(), INT8), range(2))
        )
    assert all(path is not None for path in done)
    assert cache_files(folder) == [f"smcspec-{INT8}.json", f"smcspec-{INT8}.safetensors"]
    assert torch.equal(logits(LlamaModel.from_folder(folder, "int8")), logits(int8))


def test_int4_weights_have_their_own_cache_read_back_to_the_same_logits(folder, monkeypatch):
    """int4 (group 32) is cached apart from int8, holds the kernel's packed tensors, and a warm
    load gives the cold load's logits exactly; a changed source rebuilds it."""
    cold = LlamaModel.from_folder(folder, "int4")
    kind = cache_kind("int4")
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("smcspec-int"))
    assert names == [f"smcspec-{kind}.json", f"smcspec-{kind}.safetensors"]
    cached = weight_cache.load(folder, kind=kind)
    keys = ("q4", "scales") if cpu_linear.available() else ("packed", "scales_zeros")
    for key, tensor in zip(keys, cold.layers[0].gate_up.quantized(), strict=True):
        assert torch.equal(cached[f"model.layers.0.mlp.gate_up.{key}"], tensor)
    made = builds_from_cache(monkeypatch)
    warm = LlamaModel.from_folder(folder, "int4")
    assert made == [True] and torch.equal(logits(warm), logits(cold))
    assert weight_cache.load(folder, INT8) is None, "int8 must not read the int4 cache"
    source = folder / "model.safetensors"
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert weight_cache.load(folder, kind=kind) is None


@pytest.mark.parametrize(
    "dtype, kind, linear", [("int4", "int4-g32", AtenInt4Linear), ("int8", "int8", Int8Linear)]
)
def test_where_the_kernel_does_not_build_weights_are_cached_in_the_fallbacks_format(
    folder, monkeypatch, dtype, kind, linear
):
    built = LlamaModel.from_folder(folder, dtype)
    monkeypatch.setattr(cpu_linear.KERNEL, "get", lambda: None)
    assert cache_kind(dtype) == kind
    cold = LlamaModel.from_folder(folder, dtype)
    assert isinstance(cold.layers[0].gate_up, linear)
    assert weight_cache.load(folder, kind=kind) is not None
    warm = LlamaModel.from_folder(folder, dtype)
    assert torch.equal(logits(warm), logits(cold))
    assert (logits(cold) - logits(built)).abs().max() < 0.05 * logits(built).abs().max()


def test_int4_logits_stay_near_the_float_model(folder):
    """4 bits per weight on random weights: close to float32, and further than int8."""
    full = logits(LlamaModel.from_folder(folder, "float32")).log_softmax(-1)
    kl = {}
    for dtype in ("int8", "int4"):
        low = logits(LlamaModel.from_folder(folder, dtype)).log_softmax(-1)
        kl[dtype] = float((full.exp() * (full - low)).sum(-1).mean())
    assert kl["int8"] < kl["int4"] < 0.05, kl


def test_a_cold_quantization_hands_its_freed_heap_back(folder, monkeypatch):
    """After quantizing (once per model) the freed temporaries' pages go back to the system
    (a cold default-pair load peaked at 3.25 GB without it, 3.03 GB with it); a warm load has
    no temporaries to give back and calls nothing. The call itself runs here without error."""
    from smcspec.models import weight_cache

    weight_cache.give_back_freed()  # glibc's malloc_trim, or nothing where there is none
    calls: list[int] = []
    monkeypatch.setattr(weight_cache, "give_back_freed", lambda: calls.append(1))
    LlamaModel.from_folder(folder, "int8")
    assert calls == [1]
    LlamaModel.from_folder(folder, "int8")
    assert calls == [1]


def test_a_gguf_file_is_quantized_once_and_cached_beside_it(tmp_path, monkeypatch):
    """int8 from a .gguf: the first load quantizes and writes <stem>.<kind>.* beside the file
    (the stem's dots kept), the next builds from the cache, to the same logits."""
    from tests.models.test_gguf_conversion import write_gguf

    path = write_gguf(tmp_path / "tiny-0.5b.gguf")
    cold = LlamaModel.from_gguf(path, "int8")
    stored = sorted(p.name for p in tmp_path.iterdir() if p.name != path.name)
    assert stored == [f"tiny-0.5b.{INT8}.json", f"tiny-0.5b.{INT8}.safetensors"]
    made = builds_from_cache(monkeypatch)
    warm = LlamaModel.from_gguf(path, "int8")
    assert made == [True]
    assert torch.equal(logits(warm), logits(cold))
