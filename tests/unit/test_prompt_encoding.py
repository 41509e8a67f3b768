"""The one prompt-encoding rule: the chat template when the model has one, the raw text when it has none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from actors.model.loader import load_metadata


@pytest.fixture(scope="module")
def base_model(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its chat template removed: a base model, as `bench load` once refused."""
    dst = tmp_path_factory.mktemp("base") / "llama"
    shutil.copytree(tiny_models["llama"], dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    return dst


def test_a_model_without_a_chat_template_gets_the_raw_prompt(base_model: Path) -> None:
    meta = load_metadata(str(base_model))
    assert meta.tokenizer.chat_template is None
    text = "Write a haiku about caches."
    assert meta.encode(text, chat=True) == meta.tokenizer.encode(text) == meta.encode(text)


def test_a_chat_model_gets_its_template(tiny_models) -> None:
    meta = load_metadata(str(tiny_models["llama"]))
    assert meta.tokenizer.chat_template is not None
    text = "Write a haiku about caches."
    templated = meta.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    assert meta.encode(text, chat=True) == list(templated) != meta.encode(text)
