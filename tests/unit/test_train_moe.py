"""`specfleet train-moe`'s training (deploy/bench/train_moe.py) on a tiny shape: it learns and loads normally."""

from __future__ import annotations

import json
import math

import pytest
import torch

from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.moe.profile import profile
from deploy.bench.train_moe import MoEShape, train
from tests.unit.helpers import load, runner, text_prompts


@pytest.mark.heavy
def test_a_short_training_learns_and_saves_a_loadable_mixtral(tiny_models, tmp_path):
    tokenizer = load(tiny_models["llama"]).tokenizer  # the fixtures' real (tiny) byte-level BPE tokenizer
    shape = MoEShape(hidden_size=32, num_layers=2, num_experts=4, intermediate_size=64, num_heads=2, num_kv_heads=1)
    report = train(tokenizer, tmp_path / "moe", shape=shape, max_steps=150, batch=4, seq_len=32, max_files=12,
                   log=lambda _: None)
    assert report.steps == 150
    assert report.train_loss < 0.8 * math.log(len(tokenizer))  # well below a uniform guess
    assert 0.0 < report.routing_entropy <= 1.0 and len(report.usage_entropy) == 2
    assert json.loads((tmp_path / "moe" / "train_report.json").read_text())["steps"] == 150
    model = load_model(str(tmp_path / "moe"), "fp32")  # the normal loading path
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4
    prompt = text_prompts(model, 1)[0]
    ours = runner(model).forward([SeqChunk("p", tuple(prompt), len(prompt))])  # (T, V)
    with torch.no_grad():
        theirs = model.hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    stats = profile(runner(model), [prompt])
    assert int(stats.load.sum()) == len(prompt) * 2 * 2
