"""Session-wide pytest fixtures: tiny random-weight models, each built on first use and kept for the session."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch

from tests.fixtures.tiny_models import DRAFT_NOISE, FAMILIES, build_tiny_model, perturbed_copy, write_tiny_gguf


def pytest_configure(config: pytest.Config) -> None:
    # The tiny models run faster on one thread, and a second OpenMP thread fighting other processes
    # for the machine's 2 cores made runtimes swing by 100x. (Subprocesses, e.g. the CLI, are unaffected.)
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: a long-running test; deselect with -m 'not slow'")


class LazyModels(Mapping[str, Path]):
    """Family -> model folder, built by `build` on first access and cached."""

    def __init__(self, build: Callable[[str], Path]) -> None:
        self._build = build
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in FAMILIES:
            raise KeyError(family)
        if family not in self._built:
            self._built[family] = self._build(family)
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_models["llama"]` -> folder of the tiny llama model (weights, config, generation config, tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return LazyModels(lambda family: build_tiny_model(family, root / family))


@pytest.fixture(scope="session")
def tiny_draft_models(tiny_models: LazyModels, tmp_path_factory: pytest.TempPathFactory) -> LazyModels:
    """`tiny_draft_models["llama"]` -> folder of a noisy copy of the tiny llama that agrees with it only partly."""
    root = tmp_path_factory.mktemp("tiny-drafts")
    return LazyModels(lambda family: perturbed_copy(tiny_models[family], root / family, DRAFT_NOISE))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_models: LazyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of an F32 GGUF file, alone in its folder, holding the tiny llama model and its tokenizer."""
    return write_tiny_gguf(tiny_models["llama"], tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama-f32.gguf")
