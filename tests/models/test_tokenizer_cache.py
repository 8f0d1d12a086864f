import copy
import json
import shutil

import pytest

from smcspec.models import tokenizer_cache
from smcspec.models.tokenizer_cache import CachedTokenizer

TEXTS = ["w1 w2 w3", "  w4\tw5\nw60  ", "w1 unknown w2", "<eos> w3 <pad>", "w7<eos>", ""]
CHATS = [
    [{"role": "user", "content": "w1 w2"}],
    [{"role": "system", "content": "w3"}, {"role": "user", "content": "w4", "name": None}],
]


@pytest.fixture
def folder(tiny_llama_folder, tmp_path):
    """A private copy of the tiny model's folder: each test starts with no store."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_folder, copy)
    for f in copy.glob("smcspec-tokenizer*"):
        f.unlink()
    return copy


def _same(cached, hf) -> None:
    """What smcspec reads of a tokenizer, the same from both."""
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert cached.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip)
    for chat in CHATS:
        for prompt in (True, False):
            kwargs = {"add_generation_prompt": prompt, "tokenize": False}
            assert cached.apply_chat_template(chat, **kwargs) == hf.apply_chat_template(
                chat, **kwargs
            )
    assert cached.get_vocab() == hf.get_vocab() and len(cached) == len(hf)
    assert cached.get_added_vocab() == hf.get_added_vocab()
    assert cached.eos_token_id == hf.eos_token_id and cached.chat_template == hf.chat_template


def test_the_first_load_stores_the_tokenizer_and_later_ones_read_it_alike(folder):
    first = tokenizer_cache.load(folder)
    assert not isinstance(first, CachedTokenizer)  # transformers' own, checked and stored
    assert (folder / "smcspec-tokenizer.json").is_file()
    assert (folder / "smcspec-tokenizer.pipeline.json").is_file()
    second = tokenizer_cache.load(folder)
    assert isinstance(second, CachedTokenizer)
    _same(second, first)


def test_what_the_store_does_not_do_goes_to_transformers(folder):
    hf = tokenizer_cache.load(folder)
    cached = tokenizer_cache.load(folder)
    assert cached._transformers is None
    assert cached.convert_ids_to_tokens([3, 1]) == hf.convert_ids_to_tokens([3, 1])
    ids = cached.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)
    assert ids == hf.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)
    assert cached._transformers is not None  # loaded for these, once


def test_a_changed_tokenizer_file_is_read_again(folder):
    tokenizer_cache.load(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"eos_token": "<pad>"}))
    assert tokenizer_cache.read(folder) is None
    again = tokenizer_cache.load(folder)
    assert not isinstance(again, CachedTokenizer) and again.eos_token_id == 0
    assert tokenizer_cache.read(folder).eos_token_id == 0


@pytest.mark.parametrize("damage", ["garbled", "other version", "no pipeline", "bad pipeline"])
def test_a_damaged_or_stale_store_is_not_read(folder, damage):
    tokenizer_cache.load(folder)
    settings = folder / "smcspec-tokenizer.json"
    if damage == "garbled":
        settings.write_text(settings.read_text()[:100])
    elif damage == "other version":
        saved = json.loads(settings.read_text())
        saved["stamp"]["versions"]["transformers"] = "0.0.1"
        settings.write_text(json.dumps(saved))
    elif damage == "no pipeline":
        (folder / "smcspec-tokenizer.pipeline.json").unlink()
    else:
        (folder / "smcspec-tokenizer.pipeline.json").write_text('{"model": 1}')
    assert tokenizer_cache.read(folder) is None
    assert not isinstance(tokenizer_cache.load(folder), CachedTokenizer)  # transformers'


def test_a_tokenizer_the_store_would_change_is_never_stored(folder):
    """transformers cleans up a word-level tokenizer's decoded spaces when told to ("w1 ." ->
    "w1."), which the store's decoding does not: such a tokenizer stays transformers'."""
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps(settings | {"clean_up_tokenization_spaces": True}))
    hf = tokenizer_cache.load(folder)
    assert tokenizer_cache.store(folder, hf) is None
    assert not isinstance(tokenizer_cache.load(folder), CachedTokenizer)


def test_settings_json_cannot_write_store_nothing(folder, monkeypatch):
    hf = tokenizer_cache.load(folder)
    for f in folder.glob("smcspec-tokenizer*"):
        f.unlink()
    real = tokenizer_cache._settings
    monkeypatch.setattr(tokenizer_cache, "_settings", lambda t: real(t) | {"x": object()})
    monkeypatch.setattr(tokenizer_cache, "_agrees", lambda *a: True)
    assert tokenizer_cache.store(folder, hf) is None
    assert not list(folder.glob("smcspec-tokenizer*"))


@pytest.mark.parametrize("fault", ["chat template", "EOS", "special tokens in text"])
def test_the_probes_reject_a_store_that_would_differ(folder, fault):
    """What `store` checks before it writes: a store that renders, ends or splits differently
    from transformers fails the probes."""
    hf = tokenizer_cache.load(folder)
    settings = tokenizer_cache._settings(hf)
    if fault == "chat template":
        settings["chat_template"] = settings["chat_template"].replace(" {%", "{%")
    elif fault == "EOS":
        settings["eos_token_id"] = 3
    else:
        settings["split_special_tokens"] = True
    # each its own copy of the pipeline, as `store` makes: CachedTokenizer sets its switches
    faulty = CachedTokenizer(copy.copy(hf.backend_tokenizer), settings, folder)
    assert tokenizer_cache._agrees(hf, faulty) is False
    sound = CachedTokenizer(copy.copy(hf.backend_tokenizer), tokenizer_cache._settings(hf), folder)
    assert tokenizer_cache._agrees(hf, sound) is True


def test_a_gguf_files_tokenizer_is_stored_beside_it_under_its_whole_name(tmp_path):
    """A .gguf's tokenizer (transformers builds it from the metadata: 14-18 s for Gemma 3's) is
    stored beside the file as <stem>.tokenizer.*, the stem's dots kept (not cut as with_suffix cuts
    them), read back alike, and read again from the file once the file changes."""
    import os

    from tests.models.test_gguf_conversion import write_gguf

    path = write_gguf(tmp_path / "tiny-0.5b.gguf")
    first = tokenizer_cache.load(path)
    assert not isinstance(first, CachedTokenizer)
    stored = sorted(f.name for f in tmp_path.iterdir() if f.name != path.name)
    assert stored == ["tiny-0.5b.tokenizer.json", "tiny-0.5b.tokenizer.pipeline.json"]
    second = tokenizer_cache.load(path)
    assert isinstance(second, CachedTokenizer)
    for text in ("hello", "hell<|im_end|>o", ""):
        for special in (True, False):
            ids = first.encode(text, add_special_tokens=special)
            assert second.encode(text, add_special_tokens=special) == ids
            assert second.decode(ids) == first.decode(ids)
    assert second.get_vocab() == first.get_vocab() and second.eos_token_id == first.eos_token_id
    os.utime(path, ns=(0, 0))  # another file in its place
    assert not isinstance(tokenizer_cache.load(path), CachedTokenizer)
