"""The guard on a CUDA device: a short step and the realistic step, paused and checked, interleaved.

    python bench/gpu_guard.py          # on a machine with a CUDA device, a few minutes
    python bench/gpu_guard.py --tiny   # a smoke run

One process (world size 1): the guard's own work on the device (its fused norm pass and grouping, the
sample, the row packed there), the row copied to the host a step late (late=True, the default on a
GPU), its sum and verdict read a step late, with no host sync of its own. That last is counted: the
synchronizing CUDA calls torch's sync debug mode reports per step, checked against paused, in fp32
and in fp16 with a GradScaler (whose own step syncs once). Without a CUDA device it prints SKIP and
exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard import _model
from guard_fixed import interleaved


def _steps(model: torch.nn.Module, make_batch, rounds: int) -> dict[str, float]:
    """Median step times (synchronized) with the guard paused and checking, shuffled each round."""
    import gradaudit

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        inputs, loss_of = make_batch()
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model(inputs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as out:
        guard = gradaudit.guard(model, max_norm=1.0, optimizer=opt, out_dir=out)
        times = interleaved(guard, step, rounds)
        anomalies = list(guard.anomalies)
        guard.remove()
    assert not anomalies, f"a correct run was flagged: {anomalies}"
    return {kind: statistics.median(values) for kind, values in times.items()}


def _host_syncs(model: torch.nn.Module, x: torch.Tensor, *, fp16: bool, steps: int) -> dict[str, float]:
    """Synchronizing CUDA calls per step (torch.cuda.set_sync_debug_mode), the guard checking and paused."""
    import gradaudit

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=fp16)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    counts: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as out:
        guard = gradaudit.guard(
            model, max_norm=1.0, optimizer=opt, out_dir=out, scaler=scaler if fp16 else None
        )
        for _ in range(3):
            step()
        for mode in ("checked", "paused"):
            if mode == "paused":
                guard.pause()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(steps):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts[mode] = sum("synchroniz" in str(w.message) for w in caught) / steps
        guard.resume()
        anomalies = list(guard.anomalies)
        guard.remove()
    assert not anomalies, f"a correct run was flagged: {anomalies}"
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (the CPU figures: bench/guard_fixed.py, bench/guard.py)")
        return 0
    device = torch.device("cuda")
    rounds = 2 if args.tiny else 25
    short = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)]).to(device)
    x = torch.randn(256, 1024, device=device)
    found = _steps(short, lambda: (x, lambda out: out.pow(2).mean()), rounds)
    print(
        f"RATIO gpu short step guard/none = {found['guard'] / found['none']:.4f} "
        f"({found['none'] * 1e3:.2f} ms without; target <= 1.05)"
    )
    for fp16 in (False, True):
        syncs = _host_syncs(short, x, fp16=fp16, steps=10)
        print(
            f"COUNT gpu host syncs per step, {'fp16 with a GradScaler' if fp16 else 'fp32'}: checked "
            f"{syncs['checked']:g}, paused {syncs['paused']:g} (target: the same)"
        )
    width, layers, vocab, seq = (64, 1, 256, 64) if args.tiny else (512, 8, 8192, 1024)
    model = _model(width=width, layers=layers, vocab=vocab).to(device)

    def batch():
        tokens = torch.randint(0, vocab, (1, seq + 1), device=device)

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

        return tokens[:, :-1], loss_of

    found = _steps(model, batch, rounds)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"RATIO gpu realistic step ({params / 1e6:.1f}M parameters, {seq} tokens) guard/none = "
        f"{found['guard'] / found['none']:.4f} ({found['none'] * 1e3:.2f} ms without; target <= 1.01)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
