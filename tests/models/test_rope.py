"""RoPE scalings: inverse frequencies against transformers' own functions at real model sizes;
native logits against transformers on tiny random models, at positions past the original
context; GGUF's forms of the scalings; the refusal of the rest and where `auto` sends it.

Every logits test also runs the model with the scaling taken away and checks that it then
misses transformers by far more than the tolerance, so none of them passes vacuously."""

import dataclasses
import json
import math

import pytest
import torch

from smcspec.models import gguf_loader, loader, rope
from smcspec.models.llama import LlamaModel
from smcspec.models.rope import Rope
from tests.models.test_llama import reference, write_gguf

TOL = {"rtol": 1e-4, "atol": 1e-4}  # as the other native-vs-transformers tests
FAR = 1e-2  # a scaling left out must miss by at least this much (100x the tolerance)
LENGTH = 48  # tokens per test sequence, past every original context below (16 or 32)


# Inverse frequencies against transformers at real sizes ------------------------------------

REAL = {
    "llama3 (Llama 3.1 8B)": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        500000.0,
        131072,
    ),
    "yarn (Qwen2.5 128k)": (
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        1e6,
        131072,
    ),
    "yarn, mscale and mscale_all_dim": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        10000.0,
        163840,
    ),
    "yarn, untruncated, own betas and attention factor": (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 8.0,
            "beta_slow": 0.5,
            "truncate": False,
            "attention_factor": 0.8,
        },
        10000.0,
        32768,
    ),
    "linear": ({"type": "linear", "factor": 4.0}, 10000.0, 16384),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 10000.0, 4096),
}


def _hf_config(scaling: dict, theta: float, max_positions: int, head_dim: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=theta,
        rope_scaling=dict(scaling),
    )


@pytest.mark.parametrize("name", REAL)
def test_inverse_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, theta, max_positions = REAL[name]
    config = _hf_config(scaling, theta, max_positions)
    mine = rope.from_hf(config.to_dict(), 128)  # transformers 5's form: rope_parameters
    # transformers 4's form, as hub configs still carry it, reads the same
    legacy = {
        "rope_scaling": scaling,
        "rope_theta": theta,
        "max_position_embeddings": max_positions,
    }
    assert rope.from_hf(legacy, 128) == mine
    kind = mine.scaling
    for seq_len in (None, max_positions + 1000, 3 * max_positions) if kind == "dynamic" else [None]:
        want, attention = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
        got = rope.inv_freq(mine, seq_len or 0)
        torch.testing.assert_close(got, want.double(), rtol=1e-5, atol=0)
        assert mine.attention_factor == pytest.approx(attention, rel=1e-12)
    assert not torch.allclose(
        rope.inv_freq(mine, 2 * max_positions), rope.inv_freq(Rope(theta, 128))
    )


def test_llama3_keeps_blends_and_interpolates():
    """Llama 3.1's numbers reach all three bands, so the blend itself is what the test above
    compared."""
    scaling, theta, max_positions = REAL["llama3 (Llama 3.1 8B)"]
    mine = rope.from_hf(_hf_config(scaling, theta, max_positions).to_dict(), 128)
    ratio = rope.inv_freq(Rope(theta, 128)) / rope.inv_freq(mine)
    kept, interpolated = ratio == 1.0, (ratio - 8.0).abs() < 1e-9
    assert kept.any() and interpolated.any() and (~kept & ~interpolated).any()


def test_config_forms_and_errors():
    base = {"max_position_embeddings": 64, "rope_theta": 500.0}
    assert rope.from_hf(base, 8) == Rope(500.0, 8)
    for empty in (None, {}, {"rope_type": "default"}):
        assert rope.from_hf({**base, "rope_scaling": empty}, 8) == Rope(500.0, 8)
    # transformers gives a top-level original_max_position_embeddings precedence
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    cfg = {**base, "rope_scaling": yarn, "original_max_position_embeddings": 32}
    assert rope.from_hf(cfg, 8).original_max_positions == 32
    with pytest.raises(ValueError, match="'llama3' needs a number for low_freq_factor"):
        rope.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 8)
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.625 turns 5 of 8"):
        rope.from_hf({**base, "partial_rotary_factor": 0.625}, 8)
    assert rope.from_hf({**base, "partial_rotary_factor": 0.5}, 8).dim == 4
    for kind in ("mrope", "made-up"):
        with pytest.raises(ValueError, match=f"rope scaling '{kind}' is not supported") as err:
            rope.from_hf({**base, "rope_scaling": {"rope_type": kind, "factor": 2.0}}, 8)
        assert "supported: default, linear, llama3, dynamic, yarn, longrope" in str(err.value)
    with pytest.raises(ValueError, match="'longrope' needs short_factor with 4 values"):
        rope.from_hf({**base, "rope_scaling": {"rope_type": "su", "long_factor": [1.0] * 4}}, 8)


# Native logits against transformers on tiny models ------------------------------------------

CASES = {  # name: (architecture, scaling, max_position_embeddings)
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}, 64),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,  # head_dim 16: keeps, blends, interpolates
        },
        128,
    ),
    "yarn": (
        "llama",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        64,
    ),
    "yarn on qwen2, untruncated ramp, mscale ratio": (
        "qwen2",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 2.0,
            "beta_slow": 0.25,
            "truncate": False,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        64,
    ),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 4.0}, 16),
}


def tiny_pair(folder, arch: str, scaling: dict | None, max_positions: int):
    """A random tiny model (head_dim 16, so several frequencies fall in each band) saved to
    `folder`, and the native model loaded from it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rope_scaling=scaling,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everything, norms around 1
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() == 32 else 0.0))
    hf.save_pretrained(folder)
    return hf, LlamaModel.from_folder(folder)


def native(model: LlamaModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position [T, V], the tokens fed in forward calls of `chunks` tokens."""
    kv = model.new_kv(num_pages=16, page_size=4)
    seq = kv.new_sequence()
    out, start = [], 0
    for n in chunks:
        out.append(model.forward(kv, [seq], [torch.tensor(ids[start : start + n])], n)[0])
        start += n
    return torch.cat(out)


def stepwise_reference(hf, ids: list[int], prefill: int) -> torch.Tensor:
    """transformers with its KV cache: `prefill` tokens in one call, then one token a call."""
    from smcspec.models.hf import HFCausalLM

    model = HFCausalLM(hf, {0})
    cache = model.new_cache()
    out = [model.forward(torch.tensor([ids[:prefill]]), cache, prefill)[0]]
    for t in ids[prefill:]:
        out.append(model.forward(torch.tensor([[t]]), cache, 1)[0])
    return torch.cat(out).float()


def with_rope(model: LlamaModel, folder, new: Rope) -> LlamaModel:
    """The same weights under another RoPE."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    return LlamaModel(dataclasses.replace(model.config, rope=new), weights)


@pytest.mark.parametrize("name", CASES)
def test_scaled_logits_match_transformers_past_the_original_context(name, tmp_path):
    arch, scaling, max_positions = CASES[name]
    hf, model = tiny_pair(tmp_path, arch, scaling, max_positions)
    assert model.config.rope.scaling == scaling["rope_type"]
    ids = torch.randint(1, 40, (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()
    if scaling["rope_type"] == "dynamic":
        # transformers rotates a token with the theta of the length reached when it is fed;
        # fed one at a time, that is the per-position rule the native engine follows.
        want = stepwise_reference(hf, ids, prefill=8)
        # One transformers call over all 48 rotates every token with theta(48) instead:
        # chunk-dependent, and not the model the decoders sample from.
        assert (reference(hf, ids) - want).abs().max() > FAR
    else:
        want = reference(hf, ids)
    for chunks in ([LENGTH], [7, 20, 21], [1] * LENGTH):
        torch.testing.assert_close(native(model, ids, chunks), want, **TOL)
    c = model.config
    ablations = [Rope(c.rope.theta, c.head_dim)]  # the scaling ignored, as before this module
    if c.rope.attention_factor != 1.0:
        ablations.append(dataclasses.replace(c.rope, attention_factor=1.0))
    for ablation in ablations:
        wrong = native(with_rope(model, tmp_path, ablation), ids, [LENGTH])
        assert (wrong - want).abs().max() > FAR, ablation


def test_int8_first_position_key_carries_yarn_attention_factor(tmp_path):
    """With int8 weights position 0 is computed apart (`LlamaModel._sink`); the key it stores
    must carry yarn's attention factor as the float path's does (up to int8 rounding)."""
    _, scaling, max_positions = CASES["yarn"]
    tiny_pair(tmp_path, "llama", scaling, max_positions)
    keys = {}
    for dtype in ("int8", "float32"):
        model = LlamaModel.from_folder(tmp_path, dtype)
        kv = model.new_kv(num_pages=4, page_size=4)
        seq = kv.new_sequence()
        model.forward(kv, [seq], [torch.tensor([7])], 1)
        keys[dtype] = kv.k.flatten(1, 2)[:, kv.slots(seq)]  # [layers, 1, kv_heads, D]
    factor = model.config.rope.attention_factor
    assert factor == pytest.approx(1 + 0.1 * math.log(4.0))

    def error(k: torch.Tensor) -> float:
        return float((k - keys["float32"]).norm() / keys["float32"].norm())

    assert error(keys["int8"]) < 0.03
    assert error(keys["int8"] / factor) > 0.1  # the sink's key without the factor


# GGUF ----------------------------------------------------------------------------------------


def _gguf_extra(scaling_keys: dict, factors=None):
    """Metadata writer for head_dim 16 (GGUF's key_length) plus the given rope keys."""
    import numpy as np

    def extra(w):
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_rope_dimension_count(16)
        for key, value in scaling_keys.items():
            add = {str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)]
            add(f"llama.{key}", value)
        if factors is not None:
            w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
        w.add_token_list([f"t{i}" for i in range(40)])

    return extra


GGUF_CASES = {  # name: (the transformers model's scaling, its GGUF rope keys)
    "llama3 as rope_freqs": (CASES["llama3"][1], {}),
    "linear": (CASES["linear"][1], {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    "linear, older key": (CASES["linear"][1], {"rope.scale_linear": 4.0}),
    "yarn": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 16,
            "rope.scaling.yarn_beta_fast": 16.0,
            "rope.scaling.yarn_beta_slow": 2.0,
        },
    ),
}


def _llama3_factors(hf) -> torch.Tensor:
    """What llama.cpp's converter writes as rope_freqs: default inv_freq / llama3 inv_freq."""
    plain = rope.inv_freq(Rope(10000.0, 16))
    return plain / hf.model.rotary_emb.inv_freq.double()


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_rope_scaling_matches_transformers(name, tmp_path):
    scaling, keys = GGUF_CASES[name]
    hf, _ = tiny_pair(tmp_path, "llama", scaling, 128)
    factors = _llama3_factors(hf) if scaling["rope_type"] == "llama3" else None
    path = tmp_path / "scaled.gguf"
    write_gguf(path, hf, arch="llama", extra=_gguf_extra(keys, factors))
    model = LlamaModel.from_gguf(path)
    ids = torch.randint(1, 40, (LENGTH,), generator=torch.Generator().manual_seed(2)).tolist()
    want = reference(hf, ids)
    torch.testing.assert_close(native(model, ids, [LENGTH]), want, **TOL)
    unscaled = LlamaModel(
        dataclasses.replace(model.config, rope=Rope(10000.0, 16)), gguf_loader.weights(path)
    )
    assert (native(unscaled, ids, [LENGTH]) - want).abs().max() > FAR
    assert loader._hf_drops_rope(str(path))


def test_transformers_gguf_loader_drops_rope_freqs(tmp_path):
    """Why the hf backend refuses a scaled Llama-family .gguf: transformers' GGUF loader builds
    the model with plain RoPE. Should this test fail, transformers has learnt it and the
    refusal in `loader` can go."""
    from transformers import AutoModelForCausalLM

    hf, _ = tiny_pair(tmp_path, "llama", CASES["llama3"][1], 128)
    write_gguf(
        tmp_path / "llama3.gguf", hf, arch="llama", extra=_gguf_extra({}, _llama3_factors(hf))
    )
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="llama3.gguf")
    assert loaded.config.rope_parameters["rope_type"] == "default"
    assert not torch.allclose(loaded.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"rope.scaling.type": "mrope"}, "rope scaling 'mrope' is not supported"),
        (
            {"rope.scaling.type": "yarn", "rope.scaling.yarn_log_multiplier": 0.1},
            "llama.rope.scaling.yarn_log_multiplier",
        ),
    ],
)
def test_gguf_refusals_come_before_the_weights(keys, match, tmp_path, monkeypatch):
    hf, _ = tiny_pair(tmp_path, "llama", None, 64)
    path = tmp_path / "refused.gguf"
    write_gguf(path, hf, arch="llama", extra=_gguf_extra(keys))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights read before the config was checked")

    monkeypatch.setattr(gguf_loader, "weights", no_weights)
    with pytest.raises(ValueError, match=match):
        LlamaModel.from_gguf(path)
    # no backend runs it right: auto refuses rather than fall back to transformers
    with pytest.raises(ValueError, match=match + ".*GGUF loader ignores RoPE scaling"):
        loader.choose_backend(str(path), "auto", "cpu", "float32")
    with pytest.raises(ValueError, match="scales RoPE"):
        loader.load(str(path), "hf", "float32", "cpu")


def test_hf_backend_refuses_a_scaled_gguf_only(tmp_path):
    hf, _ = tiny_pair(tmp_path, "llama", CASES["llama3"][1], 128)
    scaled, plain = tmp_path / "scaled.gguf", tmp_path / "plain.gguf"
    write_gguf(scaled, hf, arch="llama", extra=_gguf_extra({}, _llama3_factors(hf)))
    write_gguf(plain, hf, arch="llama", extra=_gguf_extra({}))
    assert loader.choose_backend(str(scaled), "auto", "cpu", "float32") == "native"
    assert loader.choose_backend(str(scaled), "auto", "cuda", "bfloat16") == "native"
    assert loader.choose_backend(str(scaled), "auto", "cuda", "float16") == "hf"
    with pytest.raises(ValueError, match=r"scales RoPE.*--backend native"):
        loader.load(str(scaled), "hf", "bfloat16", "cuda")  # refused before any loading
    assert not loader._hf_drops_rope(str(plain))


# Refusal and the auto backend on folders -----------------------------------------------------


def _tiny_folders(tmp_path, name: str, config_change) -> list[str]:
    """Two tiny llama folders (tokenizer included), `config_change(config dict)` applied to
    their config.json and the model saved again from it (weights of the changed shapes)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from tests.conftest import save_tiny_model

    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"{name}-{seed}"
        save_tiny_model(folder, seed=seed, arch="llama")
        config = json.loads((folder / "config.json").read_text())
        config_change(config)
        torch.manual_seed(seed)
        LlamaForCausalLM(HFLlamaConfig(**config)).save_pretrained(folder)
        folders.append(str(folder))
    return folders


def test_unsupported_scaling_is_refused_before_the_weights(tmp_path, monkeypatch):
    import safetensors.torch

    from tests.conftest import save_tiny_model

    folder = tmp_path / "made-up"
    save_tiny_model(folder, arch="llama")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "made-up", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights read before the config was checked")

    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    with pytest.raises(ValueError, match="rope scaling 'made-up' is not supported") as err:
        LlamaModel.from_folder(folder)
    assert "supported: default, linear, llama3, dynamic, yarn, longrope" in str(err.value)
    with pytest.raises(ValueError, match=r"'made-up'.*use --backend hf"):
        loader.load_native(str(folder), "float32", "cpu")


def test_auto_falls_back_to_transformers_explicit_native_refuses(tmp_path):
    """A folder transformers runs and the native engine does not (a Llama with biases in its
    MLP, `mlp_bias`): auto takes transformers, native refuses naming the setting."""
    from smcspec import LLM

    target, draft = _tiny_folders(tmp_path, "mlp-bias", lambda c: c.update(mlp_bias=True))
    assert loader.choose_backend(target, "auto", "cpu", "int8") == "hf"
    assert loader.choose_backend(target, "native", "cpu", "int8") == "native"  # asked for
    llm = LLM(target, draft, backend="auto", dtype="float32")
    assert llm.backend == "hf"
    assert llm.target.model.config.mlp_bias
    with pytest.raises(ValueError, match="mlp_bias"):
        LLM(target, draft, backend="native", dtype="float32")


def test_auto_keeps_native_for_a_supported_scaling(tmp_path):
    _, scaling, max_positions = CASES["llama3"]
    tiny_pair(tmp_path, "llama", scaling, max_positions)
    assert loader.choose_backend(str(tmp_path), "auto", "cpu", "int8") == "native"
    assert loader.native_refusal(str(tmp_path)) is None
