"""`bench fidelity`'s prompts: the README's as chat messages, or as plain text for a model without
a chat template (a pretrained one, Gemma 3 270M's GGUF), which once stopped the command with
transformers' "chat_template is not set"."""

import json
import shutil

from smcspec.bench.fidelity import README_PROMPTS, run_fidelity
from smcspec.models.loader import load_tokenizer


def test_a_model_without_a_chat_template_is_measured_on_plain_text(tiny_llama_folder, tmp_path):
    folder = tmp_path / "pretrained"
    shutil.copytree(tiny_llama_folder, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    for f in folder.glob("chat_template*"):
        f.unlink()
    for f in folder.glob("smcspec-tokenizer*"):
        f.unlink()
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.chat_template is None
    text = run_fidelity({"target": str(folder)}, tokenizer, "int8", 2, tmp_path / "out")
    assert "as plain text (the model has no chat template)" in text
    # each prompt as its own tokens plus 2 greedy ones, every position scored
    positions = sum(len(tokenizer.encode(p)) + 2 for p in README_PROMPTS)
    assert f"| target | {positions} |" in text


def test_a_chat_model_is_measured_on_its_chat(tiny_llama_folder, tmp_path):
    tokenizer = load_tokenizer(str(tiny_llama_folder))
    text = run_fidelity({"target": str(tiny_llama_folder)}, tokenizer, "int8", 2, tmp_path)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in README_PROMPTS
    ]
    positions = sum(len(tokenizer.encode(c, add_special_tokens=False)) + 2 for c in chats)
    assert "as chat messages" in text and f"| target | {positions} |" in text
