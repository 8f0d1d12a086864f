"""Shared fixtures: a tiny random Qwen2 model with its own word-level tokenizer (and a chat
template that joins the messages), saved to a local folder, so both backends, the engine and the
server are tested without any download."""

import os

import pytest
import torch

# Triton decides at `import triton` whether its own `tl` helpers (tl.zeros, ...) are compiled or
# interpreted, and a kernel interpreted later cannot call compiled helpers ("Cannot call
# @triton.jit'd outside of the scope of a kernel"). The CPU tests run the paged kernel in the
# interpreter, so the switch is set here, before any test module can import Triton (a module
# collected earlier that imports it, even indirectly, would otherwise decide for the process).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]  # 64 tokens


def save_tiny_model(folder, seed: int = 0, words=WORDS, arch: str = "qwen2") -> None:
    """arch "qwen2" or "llama". Text prompts need "llama": transformers 5 loads a qwen2 folder's
    tokenizer as its own byte-level BPE class, which this word-level vocabulary does not fit."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    save_random_model(folder, tok, seed, arch)


def save_random_model(
    folder, tokenizer, seed: int, arch: str = "llama", max_positions: int = 128
) -> None:
    """A tiny random model (2 layers, hidden 32, EOS id 1) over `tokenizer`'s vocabulary,
    saved with the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def pytest_configure(config):
    """Under pytest-xdist each worker gets one core: one torch thread per worker, so two
    workers on a 2-core machine never wait for each other's threads."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread():
    """Toy-model tests run thousands of decodes of tensors with a handful of entries: there a
    second intra-op thread only adds a wake-up per operation (and, on a busy machine, a wait for
    a free core: 6x slower measured), so they run on one and give the setting back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-target")
    save_tiny_model(folder, seed=0)
    return folder


@pytest.fixture(scope="session")
def tiny_draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_model(folder, seed=1)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-target")
    save_tiny_model(folder, seed=0, arch="llama")
    return folder


@pytest.fixture(scope="session")
def tiny_llama_draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-draft")
    save_tiny_model(folder, seed=1, arch="llama")
    return folder


class Loading(Exception):
    """Raised where a model would be looked for: everything before it was accepted."""


@pytest.fixture
def no_loading(monkeypatch):
    """Refuse, with `Loading`, any model being looked for, downloaded or loaded (the serving
    bench's server loads them too): what runs before it was checked without a model."""

    def refuse(*args, **kwargs):
        raise Loading

    monkeypatch.setattr("smcspec.models.defaults.ensure", refuse)
    monkeypatch.setattr("smcspec.models.loader.load", refuse)
    monkeypatch.setattr("smcspec.bench.serving.run_serve_bench", refuse)
