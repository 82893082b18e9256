"""Capture subjects: what `gradaudit.audit_step` costs at the end of a training step, against
`safetensors.torch.save_file` of the same gradients. Each builds the same model and gradients
(fixed seed) before its clock starts; the clock covers only the capture and the write."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path

HIDDEN = 2048
MAX_NORM = 1.0


def model_with_gradients(num_params: int):
    """A stack of square Linear layers with about `num_params` parameters, after one backward."""
    import torch

    torch.manual_seed(0)
    hidden = HIDDEN if num_params >= 4 * HIDDEN * HIDDEN else max(8, int(math.sqrt(num_params / 4)))
    num_layers = max(1, round(num_params / (hidden * hidden + hidden)))
    model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(num_layers)))
    model(torch.randn(4, hidden)).square().mean().backward()
    return model


def save_file_subject(num_params: int, workdir: str) -> tuple[float, int]:
    """safetensors.torch.save_file of every gradient: the baseline."""
    import torch
    from safetensors.torch import save_file

    model = model_with_gradients(num_params)
    directory = Path(tempfile.mkdtemp(dir=_made(workdir)))
    try:
        save_file({"warmup": torch.zeros(4)}, str(directory / "warmup.safetensors"))
        start = time.perf_counter()
        grads = {name: p.grad for name, p in model.named_parameters()}
        save_file(grads, str(directory / "grads.safetensors"))
        seconds = time.perf_counter() - start
        return seconds, (directory / "grads.safetensors").stat().st_size
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def audit_step_subject(num_params: int, workdir: str, mode: str) -> tuple[float, int]:
    """gradaudit.audit_step around the end of the step: the training code's own norm is recorded, the
    file is written when the context exits. The norm is computed before the clock starts."""
    import torch

    import gradaudit

    model = model_with_gradients(num_params)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    directory = Path(tempfile.mkdtemp(dir=_made(workdir)))
    try:
        # One untimed step on a tiny model first: the first use imports the capture code (a one-off
        # cost per training run, not per step).
        with gradaudit.audit_step(
            model_with_gradients(1000), directory / "warmup", step=0, max_norm=MAX_NORM, mode=mode
        ):
            pass
        start = time.perf_counter()
        with gradaudit.audit_step(
            model, directory, step=1, max_norm=MAX_NORM, mode=mode, strict=True
        ) as audit:
            audit.record(reported_norm=norm)
        seconds = time.perf_counter() - start
        written = sum(p.stat().st_size for p in (directory / "step_1").glob("*.safetensors"))
        if written == 0:
            raise SystemExit(f"audit_step wrote nothing under {directory}")
        return seconds, written
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def many_small_gradients(num_params: int):
    """`num_params` parameters of 4 elements each (experts x layers x weights of a large MoE rank, in
    miniature), each with a gradient."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(num_params))
    for parameter in model:
        parameter.grad = torch.randn(4)
    return model


def many_params_subject(num_params: int, workdir: str, mode: str) -> tuple[float, int]:
    """One audited step of `num_params` small parameters: what the capture adds to the training step."""
    import gradaudit

    model = many_small_gradients(num_params)
    directory = Path(tempfile.mkdtemp(dir=_made(workdir)))
    try:
        with gradaudit.audit_step(
            many_small_gradients(10), directory / "warmup", step=0, max_norm=MAX_NORM, mode=mode
        ):
            pass
        start = time.perf_counter()
        with gradaudit.audit_step(
            model, directory, step=1, max_norm=MAX_NORM, mode=mode, strict=True
        ) as audit:
            audit.record(reported_norm=1.0)
        seconds = time.perf_counter() - start
        written = sum(p.stat().st_size for p in (directory / "step_1").glob("*.safetensors"))
        if written == 0:
            raise SystemExit(f"audit_step wrote nothing under {directory}")
        return seconds, written
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def norm_loop_subject(num_params: int) -> tuple[float, int]:
    """The baseline: a plain float64 norm of every gradient of the same parameters, one call each."""
    import torch

    grads = [p.grad for p in many_small_gradients(num_params)]
    torch.linalg.vector_norm(torch.ones(4), dtype=torch.float64)
    start = time.perf_counter()
    for grad in grads:
        torch.linalg.vector_norm(grad, dtype=torch.float64)
    return time.perf_counter() - start, 0


def _made(workdir: str) -> str:
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return workdir


def run_capture_subject(name: str, args: dict) -> tuple[float, int]:
    import safetensors.torch  # noqa: F401 - imported before any clock starts
    import torch  # noqa: F401

    if name == "save_file":
        return save_file_subject(**args)
    if name == "many_params":
        return many_params_subject(**args)
    if name == "norm_loop":
        return norm_loop_subject(**args)
    return audit_step_subject(**args)
