"""A pair whose tables are padded differently over one tokenizer (Qwen2.5-7B's 152,064 rows,
0.5B's 151,936): both models cut to the ids they share (`models.shared_vocab`), and sd and msd
exact against the target's law over those ids, with the target's padding rows carrying real
mass that a bare sampler would hand out. Toy models: a target with 6 rows, a draft with 5, EOS
0; the oracle enumerates the target cut to 5 ids."""

from collections import Counter

import pytest
import torch

from smcspec import LLM
from smcspec.config import MSDConfig, SamplingConfig, SDConfig
from smcspec.decoding import AutoregressiveDecoder, MultiDraftDecoder, SpeculativeDecoder
from smcspec.models.shared_vocab import SharedVocab, shared
from smcspec.models.toy import ToyLM, random_lm
from tests.decoding.conftest import PROMPT
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

R = 20000
CFG = SamplingConfig(temperature=1.0, max_new_tokens=3)
WIDTH = 5


@pytest.fixture(scope="module")
def pair():
    """(target with 6 rows, draft with 5): the target's sixth row gets a logit of its own, about
    a sixth of its mass, that the shared law must drop."""
    return random_lm(WIDTH + 1, seed=21), random_lm(WIDTH, seed=22)


def cut(model: ToyLM) -> ToyLM:
    """The oracle's target: the same logits over ids 0 .. WIDTH - 1, written out apart."""
    return ToyLM(lambda p: model.logits(p)[:WIDTH], WIDTH, set(model.eos_token_ids))


def draw(decoder, seed: int, r: int = R) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(decoder.decode(PROMPT, CFG, g).tokens) for _ in range(r))


def test_the_pair_is_cut_to_the_smaller_table(pair):
    target, draft = shared(*pair, tokens=None)
    assert isinstance(target, SharedVocab) and draft is pair[1]
    assert target.vocab_size == draft.vocab_size == WIDTH
    cache = target.new_cache()
    assert target.forward(torch.tensor([PROMPT]), cache, 1).shape == (1, 1, WIDTH)
    assert shared(pair[0], pair[0], tokens=6) == (pair[0], pair[0])  # same tables: untouched


@pytest.mark.parametrize(
    "make",
    [
        lambda t, d: AutoregressiveDecoder(t),
        lambda t, d: SpeculativeDecoder(t, d, SDConfig(2)),
        lambda t, d: MultiDraftDecoder(t, d, MSDConfig(2, 2)),
    ],
    ids=["ar", "sd", "msd"],
)
def test_decoding_is_exact_against_the_targets_law_over_the_shared_ids(pair, make):
    target, draft = shared(*pair, tokens=None)
    samples = draw(make(target, draft), seed=3)
    assert chi_square_pvalue(samples, sequence_law(cut(pair[0]), PROMPT, CFG)) > ALPHA


def test_power_a_draft_padded_to_the_targets_table_is_rejected(pair):
    """The naive fix, the draft's table padded with -inf rows up to the target's and the target
    left whole, samples the target's padding id: the test rejects it from a quarter of R."""
    target, draft = pair

    def padded(prefix):
        return torch.cat([draft.logits(prefix), torch.tensor([-float("inf")])])

    wide_draft = ToyLM(padded, WIDTH + 1, set(draft.eos_token_ids))
    samples = draw(SpeculativeDecoder(target, wide_draft, SDConfig(2)), seed=4, r=R // 4)
    assert chi_square_pvalue(samples, sequence_law(cut(target), PROMPT, CFG)) < ALPHA


class _Tokenizer:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_the_llm_takes_a_padded_pair_and_refuses_one_beyond_padding(pair):
    llm = LLM.from_models(*pair)
    assert llm.vocab_size == WIDTH
    out = llm.generate(PROMPT, "sd", draft_tokens=2, max_new_tokens=3, seed=0)
    assert all(0 <= t < WIDTH for t in out.token_ids)
    assert LLM.from_models(*pair, tokenizer=_Tokenizer(WIDTH)).vocab_size == WIDTH  # the limit
    with pytest.raises(ValueError, match="the tokenizer has 6 tokens, more than the smaller"):
        LLM.from_models(*pair, tokenizer=_Tokenizer(WIDTH + 1))


def test_a_folder_whose_table_is_padded_loads_beside_its_draft(
    tiny_llama_folder, tiny_llama_draft_folder, tmp_path
):
    """The user's case from the folders: a target whose embedding and output tables were padded
    to 80 rows (as Qwen2.5-7B's are) over the draft's 64-token tokenizer loads, is cut to 64 ids,
    and generates text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder)
    model.resize_token_embeddings(80)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_llama_folder).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), str(tiny_llama_draft_folder), dtype="float32")
    assert llm.target.inner.vocab_size == 80 and llm.vocab_size == llm.draft.vocab_size == 64
    out = llm.generate("w1 w2 w3", "sd", draft_tokens=2, max_new_tokens=6, seed=0)
    assert len(out.token_ids) > 0 and all(t < 64 for t in out.token_ids)
