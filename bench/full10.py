"""A many-piece full-mode (format 1.0) step, for timing the loader's JSON pieces path.

    PYTHONPATH=$PWD python bench/full10.py DIR [--params 20000] [--ranks 4]
    python -m gradaudit check DIR/step_1 --format json     # time it, whole process

Every rank holds a flat quarter of every parameter (FSDP1-like), with its gradient before and
after clipping; half the parameters are 2-D boxes instead (tensor-parallel-like rows).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def write(directory: Path, *, num_params: int, num_ranks: int) -> Path:
    import torch

    from gradaudit.capture.build import box, flat, write_rank
    from gradaudit.model import ClipRecord
    from gradaudit.norms import expected_clip_coef

    rows, cols = num_ranks, 8
    shapes = {f"layer{i}.w": (rows, cols) for i in range(num_params)}
    gen = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    true_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = expected_clip_coef(true_norm, 1.0)
    clip = ClipRecord(max_norm=1.0, reported_norm=true_norm, clip_coef=coef)
    step = directory / "step_1"
    for rank in range(num_ranks):
        pieces = []
        for i, (name, g) in enumerate(grads.items()):
            if i % 2:
                part = g[rank : rank + 1]
                pieces.append(box(name, (rank, 0), part, grad_clipped=part * min(coef, 1.0)))
            else:
                part = g.flatten()[rank * cols : (rank + 1) * cols]
                pieces.append(flat(name, rank * cols, part, grad_clipped=part * min(coef, 1.0)))
        write_rank(
            step, rank=rank, world_size=num_ranks, step=1, params=shapes, pieces=pieces, clip=clip,
            run_id="bench", host="bench", created_at="2026-01-01T00:00:00+00:00",
        )  # fmt: skip
    return step


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--params", type=int, default=20000)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    print(write(args.directory, num_params=args.params, num_ranks=args.ranks))
