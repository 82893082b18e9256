"""Processes the capture-fault tests start: one audited training step, or a large rank file written
until the test kills it (`python -m tests.hostile.fault_workers NAME ARGS...`)."""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch


def train_step(out_dir: str | None, mode: str = "stats") -> dict[str, object]:
    """One SGD step of a small fixed model, audited into `out_dir` (None: without gradaudit). Returns
    the parameters after the step as exact bit patterns, and the warnings gradaudit gave."""
    import gradaudit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 4)

    def step() -> None:
        model(batch).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if out_dir is None:
            step()
        else:
            with gradaudit.audit_step(model, out_dir, step=1, max_norm=0.05, mode=mode, optimizer=optimizer):
                step()
    bits = {name: p.detach().view(-1).view(torch.int32).tolist() for name, p in model.named_parameters()}
    return {"params": bits, "warnings": [str(w.message) for w in caught]}


def write_large_rank(step_dir: str, num_elements: int) -> None:
    """Write rank 1 of a 2-rank full-mode step with one large gradient, slowly (1 MiB per write), so
    that the test can kill the process in the middle of the write."""
    from gradaudit.capture.build import whole, write_rank
    from gradaudit.dumpfile import writer
    from gradaudit.model import ClipRecord

    write_all = writer._write_all

    def slowly(handle, data):  # the disk of a busy cluster, in miniature: the bytes go out in full
        write_all(handle, data)
        time.sleep(0.02)

    writer._WRITE_BYTES = 1 << 20
    writer._write_all = slowly
    print("writing", flush=True)
    write_rank(
        step_dir,
        rank=1,
        world_size=2,
        step=1,
        params={"w": (num_elements,)},
        pieces=[whole("w", grad=torch.ones(num_elements))],
        clip=ClipRecord(max_norm=1.0),
    )


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "train_step":
        print(json.dumps(train_step(args[0] if args[0] != "-" else None, *args[1:])))
    elif name == "write_large_rank":
        write_large_rank(args[0], int(args[1]))
