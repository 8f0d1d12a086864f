"""A model's tokenizer as transformers builds it, stored once and read back with `tokenizers`
alone.

transformers takes about 1.4 s to start Qwen2.5's tokenizer on a 2-core Xeon: 0.65 s of
imports, then it parses the 11 MB tokenizer.json in Python and rebuilds the BPE pipeline its
class defines (which is not always the file's: Qwen2's class adds an NFC normalizer the
shipped file lacks). That was a third of a warm `smcspec generate`. The pipeline it builds
serializes (`backend_tokenizer.to_str()`), and `tokenizers` reads that back in about 0.3 s.

So the first load of a folder builds transformers' tokenizer, checks on probe texts and chats
that `CachedTokenizer` gives what it gives (`_agrees`), and only then stores the pipeline and
the few settings smcspec reads (EOS id, added tokens, chat template, special tokens) beside
the weights' cache, stamped with the SHA-256 of the tokenizer files and the transformers and
tokenizers versions. Later loads read the store. A tokenizer whose class changes encoding or
decoding, whose decoding cleans up spaces, or whose chat templates are several is never
stored: transformers keeps serving it.

`CachedTokenizer` does encode, decode, the vocabulary and single-chat templates itself;
anything else (batched chats, `tokenize=True`, other attributes) goes to transformers' own
tokenizer, loaded on first need.
"""

from __future__ import annotations

import copy
import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from smcspec.models import weight_cache

KIND = "tokenizer"
FORMAT = 1  # bump when what is stored changes meaning
# the names a folder's tokenizer files start with
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template", "added")
# methods transformers' fast tokenizer runs for what CachedTokenizer does itself: a class that
# redefines one of them is not stored
_METHODS = ("encode", "_encode_plus", "decode", "_decode", "apply_chat_template", "get_vocab")
_PROBE_TEXTS = (
    "hi",
    "Write a Python function that checks if a number is prime.",
    "def f(x):\n\treturn x ** 2  # squared\r\n\n\n",
    "  leading, trailing and   inner spaces  ",
    "cafe\u0301 and café, naïve, Ångström",  # NFC makes the first two one word
    "数学 ∑ 🤖 ½ ﬁ",
    "",
)
_PROBE_CHATS = (
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "tool_calls": None},
        {"role": "user", "content": "Again."},
    ],
)
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


class CachedTokenizer:
    """transformers' fast tokenizer of `source`, read from its store: `backend` is the
    `tokenizers.Tokenizer` it runs, `settings` what the store keeps beside it."""

    def __init__(self, backend: Any, settings: dict[str, Any], source: Path) -> None:
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = settings["split_special_tokens"]
        self.backend_tokenizer = backend
        self.chat_template: str | None = settings["chat_template"]
        self.eos_token_id: int | None = settings["eos_token_id"]
        self.special_tokens_map: dict[str, Any] = settings["special_tokens_map"]
        self._added: dict[str, int] = settings["added_vocab"]
        self.source = source
        self._transformers: Any = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._added)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One chat rendered as transformers renders it with `tokenize=False`; anything else
        (token ids, a batch, a named template, documents) is transformers' own call."""
        plain = isinstance(conversation, list) and all(isinstance(m, dict) for m in conversation)
        if tokenize or kwargs or not conversation or not plain or self.chat_template is None:
            hf = self.transformers_tokenizer
            settings = {"add_generation_prompt": add_generation_prompt, "tokenize": tokenize}
            return hf.apply_chat_template(conversation, tools=tools, **settings, **kwargs)
        from transformers.utils.chat_template_utils import render_jinja_template

        # transformers drops None values first: templates would print them as "None"
        chat = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        rendered, _ = render_jinja_template(
            conversations=[chat],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
        return rendered[0]

    @property
    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer of the same files, loaded on first use."""
        if self._transformers is None:
            self._transformers = _transformers(self.source)
        return self._transformers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_transformers", "source"):
            raise AttributeError(name)  # copying or unpickling: no fields yet
        return getattr(self.transformers_tokenizer, name)


def load(folder: Path, cache_root: Path | None = None) -> Any:
    """The tokenizer of a model folder or .gguf file: its store when there is a valid one, else
    transformers' tokenizer, stored for next time when `CachedTokenizer` agrees with it."""
    cached = read(folder, cache_root)
    if cached is not None:
        return cached
    tokenizer = _transformers(folder)
    store(folder, tokenizer, cache_root)
    return tokenizer


def _transformers(source: Path) -> Any:
    """transformers' tokenizer of a folder, or of a .gguf file (built from its metadata: 14 s
    for Gemma 3's 262k-token vocabulary on a 2-core Xeon, against 0.3 s from the store)."""
    from transformers import AutoTokenizer

    if source.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    return AutoTokenizer.from_pretrained(str(source))


def read(folder: Path, cache_root: Path | None = None) -> CachedTokenizer | None:
    """The stored tokenizer of `folder`, or None when there is none or it is stale."""
    where = weight_cache.location(folder, KIND, cache_root)
    settings_file, backend_file = _files(where)
    if not (settings_file.is_file() and backend_file.is_file()):
        return None
    try:
        saved = json.loads(settings_file.read_text())
    except ValueError:
        return None
    if not isinstance(saved, dict) or saved.get("stamp") != stamp(folder):
        return None
    from tokenizers import Tokenizer

    try:
        return CachedTokenizer(Tokenizer.from_file(str(backend_file)), saved, folder)
    except Exception:  # tokenizers' parse errors are plain Exceptions; transformers will do
        return None


def store(folder: Path, tokenizer: Any, cache_root: Path | None = None) -> Path | None:
    """Store transformers' `tokenizer` of `folder` where `CachedTokenizer` reproduces it.
    Returns the settings file, or None when not stored (it would differ, or nowhere is
    writable)."""
    settings = _settings(tokenizer)
    if settings is None:
        return None
    backend = copy.copy(tokenizer.backend_tokenizer)
    if not _agrees(tokenizer, CachedTokenizer(copy.copy(backend), settings, folder)):
        return None
    try:
        text = json.dumps(settings | {"stamp": stamp(folder)})
    except TypeError:  # a special token held as an object JSON cannot write
        return None
    where = weight_cache.location(folder, KIND, cache_root)
    settings_file, backend_file = _files(where)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        # the pipeline first, the settings (which carry the stamp) last: a half-written store
        # has no valid stamp, so it is never read
        weight_cache.write_whole(backend_file, backend.to_str())
        weight_cache.write_whole(settings_file, text)
    except OSError:
        return None
    return settings_file


def stamp(folder: Path) -> dict[str, Any]:
    """What a store holds for: the tokenizer files' names and SHA-256 (config.json too, which
    names the model type), or a .gguf file's name, size and modification time (hashing up to
    gigabytes of weights for their vocabulary would cost more than building it), and the
    versions that built and read it."""
    versions = {p: _version(p) for p in ("transformers", "tokenizers")}
    if folder.suffix == ".gguf":
        st = folder.stat()
        files: list[list[Any]] = [[folder.name, st.st_size, st.st_mtime_ns]]
        return {"format": FORMAT, "files": files, "versions": versions}
    names = [f for f in sorted(folder.iterdir()) if f.name.startswith(TOKENIZER_FILES)]
    paths = [f for f in [*names, folder / "config.json"] if f.is_file()]
    files = [[f.name, hashlib.sha256(f.read_bytes()).hexdigest()] for f in paths]
    return {"format": FORMAT, "files": files, "versions": versions}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _settings(tokenizer: Any) -> dict[str, Any] | None:
    """What `CachedTokenizer` needs beside the pipeline, or None when transformers does more
    than it would: another class's encoding or decoding, a clean-up of decoded spaces, a dict
    of named templates."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if any(getattr(cls, m) is not getattr(PreTrainedTokenizerFast, m) for m in _METHODS):
        return None
    template = tokenizer.chat_template
    if tokenizer.clean_up_tokenization_spaces or not isinstance(template, (str, type(None))):
        return None
    return {
        "chat_template": template,
        "eos_token_id": tokenizer.eos_token_id,
        "special_tokens_map": tokenizer.special_tokens_map,
        "added_vocab": tokenizer.get_added_vocab(),
        "split_special_tokens": bool(tokenizer.split_special_tokens),
    }


def _agrees(tokenizer: Any, cached: CachedTokenizer) -> bool:
    """Whether `cached` encodes, decodes and renders the probes as transformers' `tokenizer`
    does: the texts with and without special tokens, each special token in text, and the chats
    with and without tools (a chat that fails to render must fail in both)."""
    texts = [*_PROBE_TEXTS, " ".join(f"a{t}b" for t in cached.get_added_vocab())]
    for text in texts:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            if cached.encode(text, add_special_tokens=special) != ids:
                return False
            for skip in (True, False):
                if cached.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return False
    if cached.get_vocab() != tokenizer.get_vocab() or cached.eos_token_id is None:
        return False
    if (cached.eos_token_id, cached.get_added_vocab()) != (
        tokenizer.eos_token_id,
        tokenizer.get_added_vocab(),
    ):
        return False
    if cached.chat_template is None:
        return True
    for chat in _PROBE_CHATS:
        for tools in (None, _PROBE_TOOLS):
            for prompt in (True, False):
                kwargs = {"tools": tools, "add_generation_prompt": prompt, "tokenize": False}
                if _rendered(tokenizer, chat, kwargs) != _rendered(cached, chat, kwargs):
                    return False
    return True


def _rendered(tokenizer: Any, chat: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
    try:
        return tokenizer.apply_chat_template(copy.deepcopy(chat), **kwargs)
    except Exception as err:  # any failure, compared by its type
        return type(err)


def _files(where: Path) -> tuple[Path, Path]:
    """The settings (with the stamp) and the pipeline of the store at `where`."""
    return weight_cache.suffixed(where, ".json"), weight_cache.suffixed(where, ".pipeline.json")
