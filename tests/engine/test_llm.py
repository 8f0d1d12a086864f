import json

import pytest
import torch

from smcspec import LLM, AutoConfig
from smcspec.engine import check_same_tokenizer
from smcspec.models.toy import perturbed_lm, random_lm

# The settings each method reads (a setting given to one that does not is refused): the tests
# that run every method give each its own.
READS = {
    "ar": (),
    "sd": ("draft_tokens",),
    "msd": ("particles", "draft_tokens"),
    "smc": ("particles", "draft_tokens", "resample_threshold"),
}


def own(method: str, **settings):
    """The settings among `settings` that `method` reads, and every sampling setting."""
    method_settings = {"particles", "draft_tokens", "resample_threshold"}
    return {k: v for k, v in settings.items() if k not in method_settings or k in READS[method]}


@pytest.fixture
def llm():
    target = random_lm(5, seed=1)
    return LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
def test_generate_returns_tokens_and_diagnostics(llm, method):
    settings = own(method, particles=4, draft_tokens=2, max_new_tokens=6, seed=3)
    out = llm.generate([1, 2], method, stop_at_eos=False, **settings)
    assert len(out.token_ids) == 6
    d = out.diagnostics
    assert d["new_tokens"] == 6 and d["seed"] == 3 and d["tokens_per_second"] > 0
    assert set(d["time_split"]) == {"prefill", "draft", "verify", "resample", "other"}
    assert sum(d["time_split"].values()) == pytest.approx(d["seconds"], rel=1e-6)
    if method == "sd":
        assert 0 <= d["acceptance_rate"] <= 1 and d["mean_accepted_length"] <= 2
    if method == "smc":
        assert len(d["weights"]) == 4 and sum(d["weights"]) == pytest.approx(1.0)
        assert len(out.particle_texts) == 4 and len(d["ess"]) == d["rounds"]
        assert "log_z_hat" in d and "resamples" in d


def test_same_seed_same_output(llm):
    a = llm.generate([1], "smc", max_new_tokens=8, seed=11)
    b = llm.generate([1], "smc", max_new_tokens=8, seed=11)
    assert a.token_ids == b.token_ids and a.particle_texts == b.particle_texts


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"particles": 0}, "particles"),
        ({"draft_tokens": 0}, "draft_tokens"),
        ({"resample_threshold": 1.5}, "resample_threshold"),
        ({"resample_threshold": -0.1}, "resample_threshold"),
        ({"temperature": -1.0}, "temperature"),
        ({"draft_temperature": -0.5}, "draft_temperature"),
        ({"temperature": True}, "temperature"),  # a bool is no temperature
        ({"draft_temperature": False}, "draft_temperature"),
        ({"draft_temperature": float("inf")}, "draft_temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"resampling": "greedy"}, "resampling"),
        ({"method": "beam"}, "method"),
    ],
)
def test_bad_settings_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([1], **kwargs)


def test_empty_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([], "ar")
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("   ", "ar")


def test_out_of_vocabulary_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([99], "ar")


def test_tables_of_other_sizes_are_cut_to_the_shared_ids():
    """(tests/decoding/test_shared_vocab.py has the law and the refusal.)"""
    assert LLM.from_models(random_lm(5, seed=1), random_lm(6, seed=1)).vocab_size == 5


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_mismatched_tokenizers_are_refused_saying_how_they_differ():
    check_same_tokenizer(_Tok({"a": 0, "b": 1}), _Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match=r"2 against 2 tokens, 2 at other ids \('a', 'b'\)"):
        check_same_tokenizer(_Tok({"a": 0, "b": 1}), _Tok({"a": 1, "b": 0}))
    target, draft = _Tok({"a": 0, "b": 1, "<x>": 2}), _Tok({"a": 0, "c": 1})
    with pytest.raises(ValueError, match="only the target's \\('b', '<x>'\\), 1 only the draft's"):
        check_same_tokenizer(target, draft)


def test_a_pair_with_the_same_tokenizer_files_loads_one_tokenizer(
    tiny_llama_folder, tiny_llama_draft_folder, tmp_path, monkeypatch
):
    import shutil

    from smcspec.models import loader

    loads = []
    real = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda spec: loads.append(spec) or real(spec))
    llm = LLM(str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native")
    assert loads == [str(tiny_llama_folder)]
    assert llm.generate("w1 w2", "sd", max_new_tokens=3, seed=0).diagnostics["new_tokens"] == 3
    # another chat template (a file of its own, or inside the config) or the config's layout:
    # still one tokenizer, since the draft's never renders a chat
    other = tmp_path / "draft"
    shutil.copytree(tiny_llama_draft_folder, other)
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    config = other / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps(settings | {"chat_template": "{{ 1 }}"}, indent=4))
    assert loader.same_tokenizer_files(str(tiny_llama_folder), str(other))
    # a setting that differs, or one byte of the vocabulary: each model gets its own, and the
    # check runs
    config.write_text(json.dumps(settings | {"eos_token": "<pad>"}))
    assert not loader.same_tokenizer_files(str(tiny_llama_folder), str(other))
    loads.clear()
    LLM(str(tiny_llama_folder), str(other), backend="native")
    assert loads == [str(tiny_llama_folder), str(other)]
    config.write_text(json.dumps(settings))
    vocab = other / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace("{", "{ ", 1))
    assert not loader.same_tokenizer_files(str(tiny_llama_folder), str(other))


def test_potentials_through_the_api():
    from smcspec.models.toy import perturbed_lm, random_lm

    target = random_lm(4, seed=5)
    llm = LLM.from_models(target, perturbed_lm(target, seed=6, noise=0.5))
    out = llm.generate(
        [1, 2],
        "smc",
        particles=4,
        draft_tokens=2,
        max_new_tokens=6,
        seed=0,
        power_alpha=2.0,
        reward=lambda text: float(text.count("3")),
        reward_every=2,
    )
    assert out.diagnostics["valid_particles"] >= 1 and out.token_ids
    local = llm.generate([1, 2], "ar", max_new_tokens=6, seed=0, power_alpha=2.0)
    assert local.token_ids
    with pytest.raises(ValueError, match="sd targets p exactly"):
        llm.generate([1, 2], "sd", power_alpha=2.0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([1, 2], "smc", regex="a+")
    with pytest.raises(ValueError, match="at most one"):
        llm.generate([1, 2], "smc", regex="a+", grammar="start: 'a'")
    with pytest.raises(ValueError, match="reward needs smc"):
        llm.generate([1, 2], "ar", reward=lambda text: 1.0)


def test_each_method_reserves_its_own_lookahead():
    """A round can write K draft tokens past the last committed one, K being the running
    method's own: sd's for sd, smc's for smc, none for ar."""
    from smcspec.config import ARConfig, SamplingConfig, SDConfig, SMCConfig
    from smcspec.engine import Request

    def request(method):
        sampling = SamplingConfig(max_new_tokens=10)
        decoding = {"ar": ARConfig(), "sd": SDConfig(6), "smc": SMCConfig(2, 2)}[method]
        return Request([1, 2, 3], decoding, sampling, None, 0)

    assert request("sd").max_length() == 3 + 10 + 6
    assert request("smc").max_length() == 3 + 10 + 2
    assert request("ar").max_length() == 3 + 10


def test_defaults_are_auto_and_resolved_per_method(llm):
    """No method: auto, exact, room for its largest K (8); sd without settings: K=4; smc: N=2,
    K=8; a potential without a method: auto (which runs smc). An explicit K applies to whichever
    method runs."""
    auto = llm.request([1])
    assert auto.method == "auto" and auto.decoding == AutoConfig()
    assert auto.decoding.exact and auto.max_length() == 1 + 128 + 8 and auto.kv_rows() == (4, 4)
    assert llm.request([1], approximate=True).decoding == AutoConfig(exact=False)
    sd = llm.request([1], "sd")
    assert sd.decoding.draft_tokens == 4 and sd.max_length() == 1 + 128 + 4
    smc = llm.request([1], "smc")
    assert (smc.decoding.particles, smc.decoding.draft_tokens, smc.max_length()) == (2, 8, 137)
    assert llm.request([1], power_alpha=2.0).method == "auto"
    assert llm.request([1], "ar", power_alpha=2.0).method == "ar"
    assert llm.request([1], "smc", draft_tokens=3).decoding.draft_tokens == 3
    assert llm.request([1], "sd", draft_tokens=3).decoding.draft_tokens == 3
    assert llm.generate([1], max_new_tokens=3, seed=0).method == "auto"


def test_particles_are_bounded_unless_large_is_allowed(llm):
    llm.request([1], "smc", particles=64)
    with pytest.raises(ValueError, match=r"particles .* 64.*allow_large"):
        llm.request([1], "smc", particles=65)
    assert llm.request([1], "smc", particles=65, allow_large=True).decoding.particles == 65


@pytest.mark.parametrize(
    ("device", "cuda_devices", "message"),
    [
        ("cuda", 0, "CUDA is not available"),
        ("cuda:0", 0, "CUDA is not available"),
        ("cuda:2", 2, "cuda:2.*2 CUDA devices"),
        ("gpu", 2, "device must be"),
        ("cuda:x", 2, "device must be"),
    ],
)
def test_the_device_is_checked_before_any_model_loads(
    monkeypatch, no_loading, device, cuda_devices, message
):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: cuda_devices)
    with pytest.raises(ValueError, match=message):
        LLM(device=device)


def test_auto_device_is_cuda_when_there_is_one(monkeypatch):
    from smcspec.models.loader import resolve_device

    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert (resolve_device("auto"), resolve_device("cuda:0"), resolve_device("cpu")) == (
        "cuda",
        "cuda:0",
        "cpu",
    )
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def _fewest_tokens_holding(llm, tokens: list[int], stop: str) -> int:
    return next(m for m in range(1, len(tokens) + 1) if stop in llm.decode_text(tokens[:m]))


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
def test_stop_strings_cut_the_text_and_end_decoding(llm, method):
    """With the same seed the run is the free run up to the first stop string: the text is cut
    just before it, the tokens end with the one that completed it, and decoding stopped. (smc
    resamples every round so that its particles' common prefix, what it can stop on, grows.)"""
    settings = own(method, particles=2, draft_tokens=2, resample_threshold=1.0, seed=4)
    settings["stop_at_eos"] = False
    free = llm.generate([1, 2], method, max_new_tokens=24, **settings)
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = " " + llm.decode_text(free.token_ids[3:5])  # "a b": ids print as words
    out = llm.generate([1, 2], method, max_new_tokens=24, stop=[stop, "never"], **settings)
    assert out.text == free.text[: free.text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: _fewest_tokens_holding(llm, free.token_ids, stop)]
    assert out.diagnostics["new_tokens"] < 24  # stopped once the stop string was certain
    assert out.to_dict()["finish_reason"] == "stop"


def test_finish_reason_is_stop_at_eos_and_length_at_the_limit(llm):
    ended = [llm.generate([1], "ar", max_new_tokens=40, seed=s) for s in range(8)]
    assert {r.finish_reason for r in ended if r.token_ids[-1] == 0} == {"stop"}
    assert {r.finish_reason for r in ended if len(r.token_ids) == 40} <= {"length"}
    assert any(r.token_ids[-1] == 0 for r in ended)
    short = llm.generate([1], "ar", max_new_tokens=1, seed=0, stop_at_eos=False)
    assert short.finish_reason == "length"


@pytest.mark.parametrize("stop", ["", ["a", ""], [3], 7, ["a", None]])
def test_bad_stop_strings_are_refused_before_decoding(llm, stop):
    with pytest.raises(ValueError, match="stop must be"):
        llm.request([1], "ar", stop=stop)


def test_generate_batch_takes_stop_strings(llm):
    settings = {"max_new_tokens": 16, "seed": 7, "stop_at_eos": False, "stop": " 3"}
    batch = llm.generate_batch([[1], [2, 3]], "sd", draft_tokens=2, **settings)
    alone = [
        llm.generate(p, "sd", draft_tokens=2, **{**settings, "seed": 7 + i})
        for i, p in enumerate([[1], [2, 3]])
    ]
    assert [(r.text, r.token_ids, r.finish_reason) for r in batch] == [
        (r.text, r.token_ids, r.finish_reason) for r in alone
    ]
    assert all(" 3" not in r.text for r in batch)


EXTREME_SAMPLING = [
    dict(temperature=1e-45),
    dict(temperature=1e-38, top_k=2),
    dict(temperature=1.4e-45, top_p=1e-9),
    dict(temperature=1e-300),
    dict(temperature=1e30),
    dict(temperature=1e38, top_p=0.5),
    dict(temperature=1.0, draft_temperature=1e-45),
    dict(temperature=1e-45, draft_temperature=1e38),
]


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
@pytest.mark.parametrize("options", EXTREME_SAMPLING)
def test_extreme_temperatures_complete_with_tokens_in_the_vocabulary(llm, method, options):
    """Issue 12: at T = 1e-45 the float32 law was NaN and the sampler returned id V."""
    settings = own(method, particles=4, draft_tokens=2, max_new_tokens=8, seed=5)
    out = llm.generate([1, 2], method, stop_at_eos=False, **settings, **options)
    assert len(out.token_ids) == 8 and all(0 <= t < 5 for t in out.token_ids)


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder, tiny_draft_folder):
    return LLM(str(tiny_folder), str(tiny_draft_folder), backend="native", dtype="float32")


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
@pytest.mark.parametrize("options", EXTREME_SAMPLING[:2] + EXTREME_SAMPLING[5:])
def test_extreme_temperatures_on_the_native_model(tiny_llm, method, options):
    settings = own(method, particles=4, draft_tokens=2, max_new_tokens=6, seed=5)
    out = tiny_llm.generate([4, 5, 6], method, stop_at_eos=False, **settings, **options)
    vocab = tiny_llm.target.vocab_size
    assert len(out.token_ids) == 6 and all(0 <= t < vocab for t in out.token_ids)
    assert tiny_llm.target.pages.used_pages == 0


def test_plan_takes_typed_configs_whose_type_picks_the_decoder(llm):
    """`plan(prompt, decoding, sampling, potential)`: the config's type picks the method, and
    `generate`'s keywords are the same request spelled loosely."""
    from smcspec import ARConfig, SamplingConfig, SDConfig, SMCConfig
    from smcspec.potentials import Power

    sampling = SamplingConfig(temperature=0.9, max_new_tokens=6, stop_at_eos=False, seed=3)
    for decoding, keywords in (
        (ARConfig(), {"method": "ar"}),
        (SDConfig(3), {"method": "sd", "draft_tokens": 3}),
        (SMCConfig(3, 2), {"method": "smc", "particles": 3, "draft_tokens": 2}),
    ):
        typed = llm.run(llm.plan([1, 2], decoding, sampling))
        loose = llm.generate(
            [1, 2], temperature=0.9, max_new_tokens=6, stop_at_eos=False, seed=3, **keywords
        )
        assert typed.method == keywords["method"] and typed.token_ids == loose.token_ids
        # the decoder that ran, by its own diagnostics: sd's acceptance, smc's particles
        assert ("acceptance_rate" in typed.diagnostics) == isinstance(decoding, SDConfig)
        assert (typed.particle_texts is not None) == isinstance(decoding, SMCConfig)
    assert llm.plan([1]).method == "auto"  # None: auto, with a potential too
    assert llm.plan([1], potential=Power(2.0)).method == "auto"
    with pytest.raises(ValueError, match="cannot take potentials"):
        llm.plan([1], SDConfig(), potential=Power(2.0))
    with pytest.raises(ValueError, match="decoding must be one of ARConfig, SDConfig, SMCConfig"):
        llm.plan([1], "smc")
    with pytest.raises(TypeError, match=r"generate\(\) got an unexpected keyword"):
        llm.generate([1], particle=3)


def test_each_method_reports_typed_stats_under_the_same_json_keys(llm):
    """The decoders' figures are dataclasses (ARStats, SDStats, SMCStats); diagnostics carry
    them under the keys they always had, the potential-only ones only with a potential."""
    from smcspec.decoding import ARStats, SDStats, SMCStats

    common = {"tokens_per_second", "new_tokens", "prompt_tokens", "seconds", "time_split"}
    common |= {"rounds", "seed"}
    smc = {"stopped", "ess", "resamples", "collapses", "weights", "log_z_hat", "chosen_particle"}
    smc |= {"draft_agreement", "agreement_positions"}
    expected = {
        ("ar", False): {"stopped"},
        ("ar", True): {"stopped", "complete"},
        ("sd", False): {"stopped", "proposed_tokens", "accepted_tokens", "acceptance_rate"}
        | {"mean_accepted_length", "tokens_per_round", "draft_agreement", "agreement_positions"},
        ("smc", False): smc,
        ("smc", True): smc | {"valid_particles", "potential_errors"},
    }
    for (method, power), keys in expected.items():
        extra = {"power_alpha": 2.0} if power else {}
        out = llm.generate([1, 2], method, max_new_tokens=4, seed=0, **extra)
        assert set(out.diagnostics) == common | keys, (method, power)
    request = llm.request([1, 2], "sd", max_new_tokens=1, seed=0)
    assert isinstance(llm.run(request).diagnostics["acceptance_rate"], type(None))
    assert {ARStats, SDStats, SMCStats} == {type(s) for s in _stats(llm)}


def _stats(llm):
    from smcspec.engine.llm import make_decoder

    out = []
    for method in ("ar", "sd", "smc"):
        request = llm.request([1, 2], method, max_new_tokens=3, seed=0)
        decoder = make_decoder(request.decoding, llm.target, llm.draft, None)
        result = decoder.decode(request.prompt_ids, request.sampling, torch.Generator())
        out.append(result.stats)
    return out


@pytest.fixture(scope="module")
def tiny_chat_llm(tiny_llama_folder, tiny_llama_draft_folder):
    """A pair with a word-level tokenizer and a chat template that joins the messages."""
    target, draft = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    return LLM(target, draft, backend="native", dtype="float32")


def test_chat_is_generate_on_the_templated_messages(tiny_chat_llm):
    llm = tiny_chat_llm
    chat = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
    other = [{"role": "user", "content": "w9 w3"}]
    ids = llm.encode_messages(chat)
    assert ids == llm.encode("w5 w1 w2", chat=False)
    given = {"max_new_tokens": 6, "stop_at_eos": False, "particles": 3, "draft_tokens": 2}
    for method in ("sd", "smc"):
        settings = own(method, **given)
        out = llm.chat(chat, method, seed=4, **settings)
        alone = llm.generate(ids, method, seed=4, **settings)
        assert (out.token_ids, out.text, out.method) == (alone.token_ids, alone.text, method)
        assert len(out.token_ids) == 6
    # a list of chats: generate_batch, chat i with seed + i, each as it decodes alone
    settings = own("sd", **given)
    outs = llm.chat([chat, other], "sd", seed=4, **settings)
    first = llm.generate(ids, "sd", seed=4, **settings)
    second = llm.generate(llm.encode_messages(other), "sd", seed=5, **settings)
    assert [o.token_ids for o in outs] == [first.token_ids, second.token_ids]


def test_a_request_past_the_models_context_is_refused_before_it_runs():
    """The prompt, the new tokens and a round of drafts past them must fit the target's
    context, as the server counts them: at the limit the request is planned, one past it is a
    ValueError naming max_new_tokens and the context, before anything decodes. Failed on: no
    check in `plan` (the native engine refused only at the pass that crossed a Phi model's
    limit, and ran any other model past its max_position_embeddings)."""
    from smcspec.config import ARConfig, SamplingConfig, SDConfig

    target = random_lm(5, seed=1)
    target.context_length = 20
    small = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    small.plan([1, 2, 3, 4], ARConfig(), SamplingConfig(max_new_tokens=16))
    small.plan([1, 2, 3, 4], SDConfig(4), SamplingConfig(max_new_tokens=12))
    with pytest.raises(ValueError, match=r"max_new_tokens.*need 21 positions.*holds 20"):
        small.plan([1, 2, 3, 4], ARConfig(), SamplingConfig(max_new_tokens=17))
    with pytest.raises(ValueError, match="4 draft tokens of lookahead need 21"):
        small.plan([1, 2, 3, 4], SDConfig(4), SamplingConfig(max_new_tokens=13))
    with pytest.raises(ValueError, match="holds 20"):
        small.generate([1, 2, 3, 4], method="ar", max_new_tokens=17)
