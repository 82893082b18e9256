"""Tiny models, data and reference gradients shared by the integration scenarios and their tests."""

from __future__ import annotations

import torch
import torch.nn as nn

MAX_NORM = 0.1
GLOBAL_BATCH = 8
IN_FEATURES = 8


class TinyNet(nn.Module):
    """fc1 (column-parallel under TP) -> relu -> fc2 (row-parallel) -> norm -> head; 3 head rows
    shard unevenly (2, 1) over 2 ranks and leave one of 4 ranks empty."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 16)
        self.fc2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(x)))))


class TiedNet(nn.Module):
    """An embedding tied to the output projection, split into two pipeline stages by `stage()`."""

    VOCAB = 10

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, self.VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def first(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.embed(tokens)))

    def last(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(tokens))


def tiny_net() -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet()
    with torch.no_grad():  # LayerNorm starts at (1, 0); make its gradients less special
        model.norm.weight.add_(torch.linspace(-0.3, 0.3, 8))
    return model


def tied_net() -> TiedNet:
    torch.manual_seed(1)
    return TiedNet()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randint(0, TiedNet.VOCAB, (GLOBAL_BATCH,), generator=gen),
        torch.randint(0, TiedNet.VOCAB, (GLOBAL_BATCH,), generator=gen),
    )


def rows(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """The index-th of `count` equal row blocks (each data-parallel rank's share of the batch)."""
    per = tensor.shape[0] // count
    return tensor[index * per : (index + 1) * per]


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference_grads_tiny() -> dict[str, torch.Tensor]:
    """Single-process gradients of TinyNet on the whole batch: what every sharded run must reproduce."""
    model = tiny_net()
    x, y = batch()
    loss_of(model(x), y).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def reference_grads_tied() -> dict[str, torch.Tensor]:
    model = tied_net()
    tokens, targets = token_batch()
    torch.nn.functional.cross_entropy(model(tokens), targets).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def norm_of(grads: dict[str, torch.Tensor], norm_type: float = 2.0) -> float:
    flat = torch.cat([g.reshape(-1).double() for g in grads.values()])
    return float(torch.linalg.vector_norm(flat, norm_type))


def write_reference_dump(out_dir, max_norm: float = MAX_NORM):
    """The single-process run of TinyNet, dumped through gradaudit itself (world size 1), clipped
    correctly: the `--reference` the sharded runs are compared with."""
    import gradaudit

    model = tiny_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=max_norm, optimizer=opt, strict=True) as audit:
        loss_of(model(x), y).backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), max_norm)
        opt.step()
    return audit.path.parent
