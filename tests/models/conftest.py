"""A tiny random Qwen2 model with its own word-level tokenizer, saved to a local folder, so the
transformers backend is tested without any download."""

import pytest
import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]  # 64 tokens


def save_tiny_model(folder, seed: int = 0, words=WORDS) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = Qwen2Config(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


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
