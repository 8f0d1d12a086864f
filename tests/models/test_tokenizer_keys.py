"""The tokenizer's two keys, field by field: the store's stamp (`tokenizer_cache.stamp`: the
tokenizer files' names and SHA-256, config.json's, the transformers and tokenizers versions, the
store's format) and the pair's shared-tokenizer key (`loader.same_tokenizer_files`: the tokenizer
files by name and SHA-256, chat templates aside). Each field each promises changes it and makes
the read miss; nothing else does. And the probes `store` runs before it writes: a store that
differs only when special tokens are skipped is refused."""

import copy
import json
import os
import shutil

import pytest

from smcspec.models import loader, tokenizer_cache
from smcspec.models.tokenizer_cache import CachedTokenizer


@pytest.fixture
def folder(tiny_llama_folder, tmp_path):
    """A private copy of the tiny model's folder (tokenizer.json, tokenizer_config.json,
    chat_template.jinja, config.json, generation_config.json, model.safetensors), no store."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_folder, copy)
    for f in copy.glob("smcspec-tokenizer*"):
        f.unlink()
    return copy


def _append(name, text="\n"):
    def change(folder, monkeypatch):
        with open(folder / name, "a") as f:
            f.write(text)

    return change


def _setting(name, **settings):
    def change(folder, monkeypatch):
        path = folder / name
        path.write_text(json.dumps(json.loads(path.read_text()) | settings))

    return change


def _new_file(name, text="{}"):
    def change(folder, monkeypatch):
        (folder / name).write_text(text)

    return change


def _version(package):
    def change(folder, monkeypatch):
        real = tokenizer_cache._version
        monkeypatch.setattr(
            tokenizer_cache, "_version", lambda p: "0.0.1" if p == package else real(p)
        )

    return change


def _format(folder, monkeypatch):
    monkeypatch.setattr(tokenizer_cache, "FORMAT", tokenizer_cache.FORMAT + 1)


def _touch(folder, monkeypatch):
    for f in folder.iterdir():
        os.utime(f, ns=(1, 1))


# each change, and whether the store's stamp must change with it
STAMP_CHANGES = {
    "tokenizer.json": (_append("tokenizer.json"), True),
    "tokenizer_config.json": (_setting("tokenizer_config.json", model_max_length=7), True),
    "chat_template.jinja": (_append("chat_template.jinja", "{# #}"), True),
    "a new tokenizer file": (_new_file("special_tokens_map.json"), True),
    "config.json": (_setting("config.json", model_type="mistral"), True),
    "transformers' version": (_version("transformers"), True),
    "tokenizers' version": (_version("tokenizers"), True),
    "format": (_format, True),
    # nothing else: the weights, the generation settings, other files, times
    "weights": (_append("model.safetensors", "x"), False),
    "generation_config.json": (_setting("generation_config.json", max_length=3), False),
    "another file": (_new_file("README.md", "# a model"), False),
    "times": (_touch, False),
}


@pytest.mark.parametrize("change", list(STAMP_CHANGES))
def test_the_tokenizer_store_stamp_changes_with_each_field_it_names_and_nothing_else(
    folder, monkeypatch, change
):
    apply, stamped = STAMP_CHANGES[change]
    tokenizer_cache.load(folder)  # transformers', stored
    before = tokenizer_cache.stamp(folder)
    assert isinstance(tokenizer_cache.read(folder), CachedTokenizer)
    apply(folder, monkeypatch)
    assert (tokenizer_cache.stamp(folder) != before) == stamped
    assert (tokenizer_cache.read(folder) is None) == stamped


# each change to one of two equal folders, and whether they then tokenize apart
SHARED_CHANGES = {
    "tokenizer.json": (_append("tokenizer.json"), True),
    "tokenizer_config.json": (_setting("tokenizer_config.json", model_max_length=7), True),
    "a new tokenizer file": (_new_file("special_tokens_map.json"), True),
    # nothing else: the chat templates (a draft's is never rendered), the model's files
    "chat_template.jinja": (_append("chat_template.jinja", "{# #}"), False),
    "a template in tokenizer_config.json": (
        _setting("tokenizer_config.json", chat_template="{{ 1 }}"),
        False,
    ),
    "a new chat template file": (_new_file("chat_template.json"), False),
    "config.json": (_setting("config.json", model_type="mistral"), False),
    "weights": (_append("model.safetensors", "x"), False),
    "times": (_touch, False),
}


@pytest.mark.parametrize("change", list(SHARED_CHANGES))
def test_the_shared_tokenizer_key_changes_with_each_tokenizer_file_and_nothing_else(
    folder, tmp_path, monkeypatch, change
):
    apply, apart = SHARED_CHANGES[change]
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    assert loader.same_tokenizer_files(str(folder), str(other))
    apply(other, monkeypatch)
    assert loader.same_tokenizer_files(str(folder), str(other)) == (not apart)


def test_the_probes_reject_a_store_that_differs_only_when_special_tokens_are_skipped(folder):
    """A pipeline whose added tokens lost their special flag decodes every id as transformers
    does, until special tokens are skipped: then it keeps "<eos>" and "<pad>"."""
    from tokenizers import Tokenizer

    hf = tokenizer_cache.load(folder)
    pipeline = json.loads(hf.backend_tokenizer.to_str())
    for token in pipeline["added_tokens"]:
        token["special"] = False
    settings = tokenizer_cache._settings(hf)
    faulty = CachedTokenizer(Tokenizer.from_str(json.dumps(pipeline)), settings, folder)
    ids = hf.encode("w1<eos> w2 <pad>")
    assert faulty.decode(ids, False) == hf.decode(ids, skip_special_tokens=False)
    assert faulty.decode(ids, True) != hf.decode(ids, skip_special_tokens=True)
    assert tokenizer_cache._agrees(hf, faulty) is False
    sound = CachedTokenizer(copy.copy(hf.backend_tokenizer), settings, folder)
    assert tokenizer_cache._agrees(hf, sound) is True
