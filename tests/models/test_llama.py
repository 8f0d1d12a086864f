"""The native Llama/Qwen2 model against transformers on the same (random) weights."""

import dataclasses

import pytest
import torch

from smcspec.kv.pages import OutOfPages
from smcspec.models.llama import LlamaModel


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everything, biases and norms included
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() == 32 else 0.0))
    hf.save_pretrained(folder)
    return hf, LlamaModel.from_folder(folder)


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def test_logits_match_transformers_on_a_ragged_batch(pair):
    hf, native = pair
    kv = native.new_kv(num_pages=32, page_size=4)
    a, b = kv.new_sequence(), kv.new_sequence()
    ids = {a: [1, 5, 9, 2, 7], b: [3, 3, 8]}
    out = native.forward(kv, [a, b], [torch.tensor(ids[a]), torch.tensor(ids[b])], 1)
    assert out.shape == (2, 1, 50)
    for row, seq in enumerate((a, b)):
        torch.testing.assert_close(out[row, 0], reference(hf, ids[seq])[-1], rtol=1e-4, atol=1e-4)
    # decode steps of different lengths, a fork, a rollback
    step = native.forward(kv, [a, b], [torch.tensor([4, 6]), torch.tensor([11])], 1)
    ids[a] += [4, 6]
    ids[b] += [11]
    for row, seq in enumerate((a, b)):
        torch.testing.assert_close(step[row, 0], reference(hf, ids[seq])[-1], rtol=1e-4, atol=1e-4)
    c = kv.fork(a)
    kv.truncate(a, 4)
    ids[c] = list(ids[a])
    ids[a] = [*ids[a][:4], 13]
    ids[c] += [17, 19]
    out = native.forward(kv, [a, c], [torch.tensor([13]), torch.tensor([17, 19])], 2)
    torch.testing.assert_close(out[1], reference(hf, ids[c])[-2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[0, -1], reference(hf, ids[a])[-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0, 0], torch.zeros(50))  # a only gave one token


def test_every_position_matches_transformers(pair):
    hf, native = pair
    kv = native.new_kv(num_pages=16, page_size=3)
    seq = kv.new_sequence()
    ids = [4, 8, 15, 16, 23, 42 % 50, 7]
    out = native.forward(kv, [seq], [torch.tensor(ids)], len(ids))[0]
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_out_of_pages_is_catchable(pair):
    _, native = pair
    kv = native.new_kv(num_pages=2, page_size=2)
    seq = kv.new_sequence()
    with pytest.raises(OutOfPages):
        native.forward(kv, [seq], [torch.tensor([1, 2, 3, 4, 5])], 1)


def test_decoder_view_matches_transformers_through_resampling(pair):
    from smcspec.models.hf import HFCausalLM
    from smcspec.models.native import NativeCausalLM

    hf, native = pair
    ref = HFCausalLM(hf, {0})
    mine = NativeCausalLM(native, {0}, num_pages=64, page_size=4)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 50, (1, 6), generator=g)
    caches = [m.new_cache() for m in (ref, mine)]
    for model, cache in zip((ref, mine), caches, strict=True):
        model.forward(prompt, cache, 1)
        cache.select(torch.tensor([0, 0, 0]))
    for _ in range(3):
        new = torch.randint(1, 50, (3, 3), generator=g)
        rows = torch.tensor([2, 0, 2])
        outs = []
        for model, cache in zip((ref, mine), caches, strict=True):
            model.forward(new, cache, 1)
            cache.select(rows)
            cache.crop(cache.length - 1)
            outs.append(model.forward(new[rows][:, -1:], cache, 1))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    # pages are shared, not copied: 3 rows of 6 + 3 * 3 tokens need far fewer than 3 x 4 pages
    assert mine.kv.allocator.used_pages < 3 * 4
    caches[1].release()
    assert mine.kv.allocator.used_pages == 0


def write_gguf(
    path, hf, quant=None, arch="qwen2", extra=None, names=None, rope_base=10000.0, shift=None
):
    """The tiny model as a GGUF file (F32, or Q8_0 for the big matrices). For llama and
    smollm3 (llama.cpp converts SmolLM3 with its Llama class), q/k rows are permuted the way
    llama.cpp's converter does. `extra(writer)` may add metadata and
    tensors (RoPE scaling); `names` (state dict name -> GGUF name) replaces the loader's own
    mapping; `shift(name)` is a number the converter adds to that tensor (Gemma's norms)."""
    import gguf
    import numpy as np

    from smcspec.models.gguf_loader import _GLOBAL, _LAYER

    if names is None:
        names = {v: k for k, v in _GLOBAL.items()}
        for i in range(hf.config.num_hidden_layers):
            names.update({f"model.layers.{i}.{v}": f"blk.{i}.{k}" for k, v in _LAYER.items()})
    w = gguf.GGUFWriter(str(path), arch)
    c = hf.config
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:  # llama.cpp writes it once
            continue
        array = tensor.detach().float().numpy() + (shift(name) if shift else 0.0)
        if arch in ("llama", "smollm3") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            rows, cols = array.shape
            array = array.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2)
            array = array.reshape(rows, cols)
        if quant is not None and array.ndim == 2:
            w.add_tensor(names[name], gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            w.add_tensor(names[name], np.ascontiguousarray(array))
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_names(hf, arch: str) -> dict[str, str]:
    """State dict name -> GGUF name as llama.cpp's converter maps them for `arch` (the `gguf`
    package's table, not the loader's)."""
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(kind, hf.config.num_hidden_layers)
    return {n: table.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf.state_dict()}


def test_gguf_f32_loads_exactly_the_same_model(pair, tmp_path):
    hf, native = pair
    write_gguf(tmp_path / "tiny.gguf", hf)
    from_gguf = LlamaModel.from_gguf(tmp_path / "tiny.gguf")
    assert from_gguf.config.rms_eps == pytest.approx(native.config.rms_eps)  # stored as fp32
    assert dataclasses.replace(from_gguf.config, rms_eps=native.config.rms_eps) == native.config
    for kv_model in (native, from_gguf):
        kv = kv_model.new_kv(8, 4)
        seq = kv.new_sequence()
        out = kv_model.forward(kv, [seq], [torch.tensor([3, 1, 4, 1, 5])], 5)
        torch.testing.assert_close(out[0], reference(hf, [3, 1, 4, 1, 5]), rtol=1e-4, atol=1e-4)


def test_gguf_q8_0_is_close(pair, tmp_path):
    import gguf

    hf, _ = pair
    write_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    model = LlamaModel.from_gguf(tmp_path / "q8.gguf")
    kv = model.new_kv(8, 4)
    out = model.forward(kv, [kv.new_sequence()], [torch.tensor([3, 1, 4, 1, 5])], 5)[0]
    want = reference(hf, [3, 1, 4, 1, 5])
    kl = torch.nn.functional.kl_div(
        out.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert kl < 1e-3  # 8-bit blocks of 32: a small, nonzero error
    assert not torch.equal(out, want)


def test_llama_architecture_from_a_permuted_gguf(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    write_gguf(tmp_path / "llama.gguf", hf, arch="llama")
    model = LlamaModel.from_gguf(tmp_path / "llama.gguf")
    assert not model.config.qkv_bias
    kv = model.new_kv(8, 4)
    ids = [5, 9, 2, 6, 5, 3]
    out = model.forward(kv, [kv.new_sequence()], [torch.tensor(ids)], len(ids))[0]
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_int8_position_zero_is_computed_apart_and_memoized(tmp_path_factory, pair):
    """With int8 weights the first position runs through the banded linears: much closer to the
    float computation with the same (de-quantized) weights than the plain int8 path, memoized per
    token id, and later positions see its keys and values."""
    from smcspec.models.layers import DenseLinear

    hf, _ = pair
    folder = tmp_path_factory.mktemp("tiny-int8")
    hf.save_pretrained(folder)
    int8 = LlamaModel.from_folder(folder, "int8")
    dequantized = LlamaModel.from_folder(folder, "float32")
    for src, dst in zip(int8.layers, dequantized.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(src, name)
            setattr(dst, name, DenseLinear(_dequantized_weight(lin), lin.bias))
    dequantized.lm_head = DenseLinear(_dequantized_weight(int8.lm_head))
    for model in (int8, dequantized):  # a sink-like token: one channel 300x the others
        model.embed[7, 3] *= 300.0
    kv_a, kv_b = int8.new_kv(8, 4), dequantized.new_kv(8, 4)
    a = int8.forward(kv_a, [kv_a.new_sequence()], [torch.tensor([7])], 1)
    b = dequantized.forward(kv_b, [kv_b.new_sequence()], [torch.tensor([7])], 1)
    plain_seq = kv_a.new_sequence()
    batch = int8.plan(kv_a, [plain_seq], [1])
    plain = int8.logits(int8.hidden(torch.tensor([7]), batch, kv_a))
    assert (a - b).abs().max() < (plain - b).abs().max()  # precise bound: test_layers
    second = kv_a.new_sequence()
    c = int8.forward(kv_a, [second], [torch.tensor([7, 3, 9])], 3)
    torch.testing.assert_close(c[:, :1], a, rtol=0, atol=0)  # memoized: the very same numbers
    assert list(int8._sinks) == [7]


def _dequantized_weight(lin) -> torch.Tensor:
    """The weights [out, in] an int8 linear multiplies by (fbgemm's or smcspec's kernel)."""
    eye = torch.eye(lin.in_features)
    bias = 0.0 if lin.bias is None else lin.bias
    return (lin.reference(eye) - bias).T
