"""Converting a GGUF file streams: the weights read from it (`gguf_loader.GGUFWeights`) and the
float32 folder written from it (`defaults._convert`) are bit for bit what `transformers`' GGUF
loader gives, and converting never holds more than about one de-quantized tensor.

The files are synthetic: random blocks of the quantization types the default pair ships
(Q4_K, Q6_K, Q5_0, Q8_0) beside F16 and F32 tensors, each block's scales set to sane float16
values so that every value is finite."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from smcspec.models import defaults, gguf_header, gguf_loader

Q = gguf.GGMLQuantizationType
QWEN_EOS = defaults.SHIPPED[defaults.DEFAULT_TARGET].eos_ids
# where each block type keeps its float16 scales (byte offsets in the block)
SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}
# each GGUF tensor of a layer: its shape in torch order (rows, cols) as a function of the sizes
LAYER = {
    "attn_q.weight": lambda h, i, kv: (h, h),
    "attn_k.weight": lambda h, i, kv: (kv, h),
    "attn_v.weight": lambda h, i, kv: (kv, h),
    "attn_output.weight": lambda h, i, kv: (h, h),
    "ffn_gate.weight": lambda h, i, kv: (i, h),
    "ffn_up.weight": lambda h, i, kv: (i, h),
    "ffn_down.weight": lambda h, i, kv: (h, i),
}
QTYPES = [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.F16, Q.F32]
# a byte-level BPE vocabulary (GPT-2's byte-to-character table) with two merges and Qwen's
# special tokens, enough for transformers to build the tokenizer of a qwen2 GGUF
_BYTES = [*range(33, 127), *range(161, 173), *range(174, 256)]
_CHARS = [chr(b) for b in _BYTES] + [chr(256 + n) for n in range(256 - len(_BYTES))]
TOKENS = [*_CHARS, "he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random stored bytes of a [rows, cols] tensor of `qtype`, scales finite."""
    if qtype == Q.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32)
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        scale = (rng.random(len(raw)) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(
    path: Path, arch: str = "qwen2", hidden: int = 256, inter: int = 512, layers: int = 2,
    tied: bool = False, seed: int = 0,
) -> Path:  # fmt: skip
    """A Llama-family GGUF of random weights, its matrices cycling through QTYPES, with a
    tokenizer; llama's q/k rows are stored permuted as llama.cpp's converter writes them, which
    the readers undo (a random matrix needs no permuting to be one)."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim = 4, 2, hidden // 4
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 3) + [3] * 3)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(len(TOKENS) - 3)
    w.add_eos_token_id(len(TOKENS) - 1)
    vocab = len(TOKENS)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for n in range(layers):
        for name, shape in LAYER.items():
            shapes[f"blk.{n}.{name}"] = shape(hidden, inter, kv_heads * head_dim)
        for norm in ("attn_norm", "ffn_norm"):
            shapes[f"blk.{n}.{norm}.weight"] = (hidden,)
        if arch == "qwen2":
            for x, rows in (("q", hidden), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                shapes[f"blk.{n}.attn_{x}.bias"] = (rows,)
    for k, (name, shape) in enumerate(shapes.items()):
        if len(shape) == 1:
            w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
            continue
        qtype = QTYPES[k % len(QTYPES)]
        data = _blocks(rng, qtype, *shape)
        raw = None if qtype in (Q.F32, Q.F16) else qtype
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_state(path: Path) -> dict[str, torch.Tensor]:
    """The reference: what transformers' GGUF loader de-quantizes (gguf's de-quantizers on each
    whole tensor, its own q/k un-permuting), the tied head left out as the old conversion did."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def old_convert(path: Path, folder: Path) -> None:
    """The conversion as it was: transformers loads the whole model de-quantized, and the
    state dict is saved at once."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    model.generation_config.eos_token_id = list(QWEN_EOS)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "COMPLETE").write_text(f"converted from {path.name}\n")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_lazy_weights_are_bit_for_bit_transformers(arch, tied, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", arch, tied=tied)
    want = transformers_state(path)
    got = gguf_loader.weights(path)
    assert sorted(got.keys()) == sorted(want)
    for name, tensor in want.items():
        assert got.shape(name) == tuple(tensor.shape), name
        assert torch.equal(_bits(got.pop(name)), _bits(tensor)), name
    assert list(got.keys()) == []  # popped: nothing held


def test_rows_de_quantize_apart(tmp_path, monkeypatch):
    """Chunks of one row (the smallest) give what whole tensors give."""
    path = write_gguf(tmp_path / "m.gguf")
    whole = gguf_loader.weights(path)
    monkeypatch.setattr(gguf_loader, "CHUNK_BYTES", 1)
    rows = gguf_loader.weights(path)
    for name in whole:
        assert torch.equal(_bits(rows[name]), _bits(whole[name])), name


@pytest.mark.parametrize("tied", [False, True])
def test_the_converted_folder_is_byte_for_byte_the_old_one(tied, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tied=tied)
    old_convert(path, tmp_path / "old")
    defaults._convert(path, tmp_path / "new", QWEN_EOS)
    names = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == names
    assert "model.safetensors" in names and "config.json" in names
    for name in names:
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes()
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied


def test_converting_holds_about_one_de_quantized_tensor(tmp_path, monkeypatch):
    """Peak traced memory while converting stays within the largest tensor's float32 size and a
    few chunks of gguf's de-quantizers, far below the whole model's: the old conversion held
    every tensor at once. numpy's buffers are traced (a tensor is a numpy array until written);
    a first conversion, untraced, imports and caches what the second needs."""
    chunk = 1 << 18
    monkeypatch.setattr(gguf_loader, "CHUNK_BYTES", chunk)
    path = write_gguf(tmp_path / "m.gguf", hidden=512, inter=2048, layers=4)
    sizes = [4 * int(np.prod(t.shape)) for t in gguf.GGUFReader(str(path)).tensors]
    bound = max(sizes) + 8 * chunk
    assert sum(sizes) > 10 * bound  # the bound is far below holding the model
    defaults._convert(path, tmp_path / "warm", QWEN_EOS)
    tracemalloc.start()
    try:
        defaults._convert(path, tmp_path / "new", QWEN_EOS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < bound, (peak, max(sizes), sum(sizes))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_header_is_what_gguf_reads(arch, tmp_path):
    """`Header` (which walks past string arrays) against gguf's GGUFReader on every field and
    tensor: scalars and strings equal, a string array its length, each tensor's shape (torch
    order), type, absolute offset and size equal."""
    path = write_gguf(tmp_path / "m.gguf", arch, layers=3)
    reader = gguf.GGUFReader(str(path))
    header = gguf_header.Header.read(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(header.metadata) == set(fields)
    for key, value in fields.items():
        strings = isinstance(value, list) and value and isinstance(value[0], str)
        assert header.metadata[key] == (len(value) if strings else value), key
    assert header.metadata["tokenizer.ggml.tokens"] == len(TOKENS)
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        entry = header.tensors[t.name]
        want = (tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), t.data_offset)
        assert (entry.shape, entry.qtype, entry.offset) == want, t.name
        assert entry.nbytes == t.n_bytes, t.name


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    table_end = min(t.offset for t in gguf_header.Header.read(path).tensors.values()) - 40
    cuts = []
    for n, end in enumerate((300, table_end)):  # in the vocabulary; in the tensor table
        cuts.append(tmp_path / f"cut{n}.gguf")
        cuts[-1].write_bytes(data[:end])
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    for bad in (*cuts, other):
        with pytest.raises(ValueError, match=str(bad)):
            gguf_header.Header.read(bad)
        assert gguf_loader.architecture(bad) is None
    assert gguf_loader.architecture(path) == "qwen2"
