"""Fixtures for tests/k8s: each overlay, and its RayService as `kubectl kustomize` builds it."""

from __future__ import annotations

import copy

import pytest

from tests.k8s.manifests import OVERLAYS, by_kind, kustomize


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rayservice(overlay: str) -> dict:
    (svc,) = by_kind(kustomize(overlay), "RayService")
    return copy.deepcopy(svc)
