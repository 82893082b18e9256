"""A model with a sparse-gradient embedding and a complex parameter, trained one step under DDP on gloo."""

from __future__ import annotations

import torch

import gradaudit

MAX_NORM = 0.1


class OddModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.lin = torch.nn.Linear(4, 2)
        self.phase = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(tokens)).sum() + (self.phase.abs() ** 2).sum()


def dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """clip_grad_norm_ cannot take a sparse gradient: training clips the others."""
    return [p for name, p in model.named_parameters() if not name.endswith("emb.weight")]


def one_step(
    model: torch.nn.Module, out_dir: str, tokens: torch.Tensor, **kwargs: object
) -> tuple[str, float]:
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, **kwargs) as audit:
        model(tokens).backward()
        norm = audit.clip(torch.nn.utils.clip_grad_norm_, dense_parameters(model), MAX_NORM)
    assert audit.path is not None
    return str(audit.path), float(norm)


def ddp_step(rank: int, world_size: int, out_dir: str) -> tuple[str, float]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(OddModel())
    return one_step(model, out_dir, torch.tensor([rank, rank + 3, 7]))
