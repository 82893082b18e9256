"""What the single-process capture tests share: a tiny model and a clean single-process environment."""

from __future__ import annotations

import pytest
import torch

from gradaudit.warn import forget_warnings

MAX_NORM = 0.05


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """No torchrun environment, and every warn-once warning may fire again."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    forget_warnings()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
