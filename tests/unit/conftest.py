"""Unit-test fixtures: which ISA our CPU kernels run on for a test (`kernel_isa`, an indirect parameter whose values
tests/unit/helpers.py isa_params lists)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from actors.model import cpu_kernels


@pytest.fixture
def kernel_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test runs with `SPECFLEET_CPU_ISA` set to its parameter, as a user sets it (chosen again before and after);
    "auto" is whatever this machine runs by default."""
    isa = request.param
    monkeypatch.setenv("SPECFLEET_CPU_ISA", isa)
    cpu_kernels.reset()
    assert isa == "auto" or cpu_kernels.isa() == isa, cpu_kernels.choice()
    yield isa
    cpu_kernels.reset()
