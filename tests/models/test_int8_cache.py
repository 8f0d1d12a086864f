"""The int8 cache: a model is quantized once; later loads read the int8 weights back and give
the very same logits; a changed source or a half-written cache is never trusted."""

import os
import shutil

import pytest
import torch

from smcspec.models import int8_cache
from smcspec.models.llama import LlamaModel
from tests.conftest import save_tiny_model

IDS = [5, 9, 3, 17, 4, 40, 2]


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


def test_the_first_load_writes_the_cache_and_the_next_reads_it(folder, monkeypatch):
    cold = LlamaModel.from_folder(folder, "int8")
    assert cache_files(folder) == ["smcspec-int8.json", "smcspec-int8.safetensors"]
    made = []
    real = LlamaModel.__init__

    def spy(self, *args, quantized=None, **kw):
        made.append(quantized is not None)
        real(self, *args, quantized=quantized, **kw)

    monkeypatch.setattr(LlamaModel, "__init__", spy)
    warm = LlamaModel.from_folder(folder, "int8")
    assert made == [True]  # built from the cache, not quantized again
    assert torch.equal(logits(warm), logits(cold))


def test_weights_are_quantized_from_the_source_not_the_cache(folder):
    """The cache holds what quantizing gives: an int8 model built without it agrees."""
    cold = LlamaModel.from_folder(folder, "int8")
    cached = int8_cache.load(folder)
    assert cached is not None and "model.layers.0.self_attn.qkv.q" in cached
    q, scale = cold.layers[0].qkv.quantized()
    assert torch.equal(cached["model.layers.0.self_attn.qkv.q"], q)
    assert torch.equal(cached["model.layers.0.self_attn.qkv.scale"], scale)


def test_a_changed_source_rebuilds_the_cache(folder):
    LlamaModel.from_folder(folder, "int8")
    source = next(folder.glob("*.safetensors"))
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert int8_cache.load(folder) is None  # the stamp no longer matches
    LlamaModel.from_folder(folder, "int8")
    assert int8_cache.load(folder) is not None


def test_a_cache_without_its_stamp_is_ignored(folder):
    LlamaModel.from_folder(folder, "int8")
    (folder / "smcspec-int8.json").unlink()  # as if the write stopped before the stamp
    assert int8_cache.load(folder) is None
    (folder / "smcspec-int8.json").write_text("{not json")
    assert int8_cache.load(folder) is None


def test_a_read_only_model_folder_caches_under_the_cache_root(folder, tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root writes anywhere: check the choice of place instead
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    else:
        folder.chmod(0o555)
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    try:
        cold = LlamaModel.from_folder(folder, "int8")
        assert cache_files(folder) == []
        where = int8_cache.location(folder)
        assert where.parent.parent == tmp_path / "cache" / "int8"
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
    (folder / "smcspec-int8.json").unlink()
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: int8_cache.save(folder, int8.int8_entries()), range(2)))
    assert all(path is not None for path in done)
    assert cache_files(folder) == ["smcspec-int8.json", "smcspec-int8.safetensors"]
    assert torch.equal(logits(LlamaModel.from_folder(folder, "int8")), logits(int8))
