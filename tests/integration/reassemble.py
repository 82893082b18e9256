"""Rebuild whole parameters from a loaded step's pieces, and audit it, for the integration tests."""

from __future__ import annotations

import math

import torch

from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.dumpfile.dump import StepDump
from gradaudit.model import Box, FlatRange


def reassemble(step: StepDump, kind: str = "grad") -> dict[str, torch.Tensor]:
    """Every logical parameter's full tensor of `kind`; asserts full coverage and equal replicas."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    with TensorReader() as reader:
        for rank in step.ranks_present:
            dump = step.ranks[rank]
            for piece in dump.pieces:
                if kind not in piece.tensors:
                    continue
                info = step.params[piece.param]
                full = out.setdefault(
                    piece.param, torch.full(info.global_shape, math.nan, dtype=torch.float64)
                )
                seen = covered.setdefault(piece.param, torch.zeros(info.global_shape, dtype=torch.bool))
                values = reader.read(dump.path, piece.tensors[kind]).double().reshape(-1)
                start = 0
                for region in piece.regions:
                    n = region.numel
                    chunk = values[start : start + n]
                    start += n
                    target, mask = _view(full, region), _view(seen, region)
                    old = target[mask]
                    if old.numel():
                        assert torch.allclose(old, chunk.reshape(target.shape)[mask], atol=1e-6), (
                            f"replicas of {piece.param} differ on rank {rank}"
                        )
                    target.copy_(chunk.reshape(target.shape))
                    mask.fill_(True)
    for name, seen in covered.items():
        assert bool(seen.all()), f"{kind} of {name}: {int((~seen).sum())} elements are held by no rank"
    return out


def _view(tensor: torch.Tensor, region) -> torch.Tensor:
    if isinstance(region, FlatRange):
        return tensor.view(-1)[region.start : region.stop]
    assert isinstance(region, Box)
    index = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape, strict=False))
    return tensor[index]


def norm_of(tensors: dict[str, torch.Tensor], norm_type: float = 2.0) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors.values()]), norm_type))


def load(path) -> StepDump:
    return load_step(path)


def audit_report(step_path, reference=None):
    """gradaudit's own report of the step folder, or None while the checker is not there yet."""
    try:
        from gradaudit.audit import audit_step_dir
        from gradaudit.checks.base import AuditOptions
    except ImportError:
        return None
    return audit_step_dir(step_path, AuditOptions(reference=None if reference is None else str(reference)))


def error_codes(report) -> set[str]:
    return {f.code for f in report.findings if f.severity.value == "error"}
