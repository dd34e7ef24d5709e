"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like / new_empty hand out NaN-filled float tensors for the duration of a test: an element
    the code under test never writes shows as NaN."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: fill(new_empty(self, *a, **k)))
