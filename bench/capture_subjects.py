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


def params_ladder_subject(
    counts: list[int], workdir: str, rounds: int, modes: list[str]
) -> tuple[float, dict]:
    """One process, every size: per round and size, a plain loop of
    `torch.linalg.vector_norm(g, dtype=torch.float64)` over the gradients, an audited step in each
    mode (`audit_step`, strict: ownership inference, snapshots, statistics, the dump built and
    written), and the loop again; the stats step's ratio is taken against the mean of the two loops
    around it. Returns {subject: [seconds per round]} and {"stats/loop N": [ratio per round]}."""
    import gradaudit

    models = {n: many_small_gradients(n) for n in counts}
    grads = {n: [p.grad for p in model] for n, model in models.items()}
    directory = Path(tempfile.mkdtemp(dir=_made(workdir)))
    times: dict[str, list[float]] = {}
    try:
        # Untimed first: the imports and first calls of the capture (once per training run).
        warm = many_small_gradients(10)
        for mode in modes:
            with gradaudit.audit_step(warm, directory / "warmup", step=0, max_norm=MAX_NORM, mode=mode):
                pass
            shutil.rmtree(directory / "warmup")
        _norm_loop(grads[counts[0]])
        step = 0
        started = time.perf_counter()
        for _ in range(rounds):
            for n in counts:
                before = _norm_loop(grads[n])
                captured = {}
                for mode in modes:
                    step += 1
                    captured[mode] = _audited_step(models[n], directory, step, mode)
                    if mode == "stats":
                        after = _norm_loop(grads[n])
                        times.setdefault(f"stats/loop {n}", []).append(
                            captured[mode] / ((before + after) / 2)
                        )
                times.setdefault(f"norm loop {n}", []).append(before)
                for mode, seconds in captured.items():
                    times.setdefault(f"{mode} {n}", []).append(seconds)
        return time.perf_counter() - started, times
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _norm_loop(grads) -> float:
    import torch

    start = time.perf_counter()
    for grad in grads:
        torch.linalg.vector_norm(grad, dtype=torch.float64)
    return time.perf_counter() - start


def _audited_step(model, directory: Path, step: int, mode: str) -> float:
    import gradaudit

    start = time.perf_counter()
    with gradaudit.audit_step(
        model, directory, step=step, max_norm=MAX_NORM, mode=mode, strict=True
    ) as audit:
        audit.record(reported_norm=1.0)
    seconds = time.perf_counter() - start
    written = directory / f"step_{step}"
    if not any(written.glob("rank_*.safetensors")):
        raise SystemExit(f"audit_step wrote nothing under {written}")
    shutil.rmtree(written)
    return seconds


def _made(workdir: str) -> str:
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return workdir


def run_capture_subject(name: str, args: dict) -> tuple[float, int]:
    import safetensors.torch  # noqa: F401 - imported before any clock starts
    import torch  # noqa: F401

    if name == "save_file":
        return save_file_subject(**args)
    if name == "params_ladder":
        return params_ladder_subject(**args)
    return audit_step_subject(**args)
