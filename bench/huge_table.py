"""Build a valid stats-mode step whose shared parameter table lists many parameters, of which the two
ranks hold 4, to time `gradaudit check` and `show` on it:

    PYTHONPATH=$PWD python bench/huge_table.py DIR/step_1 100000
    /usr/bin/time -f "%e s %M KB" gradaudit check DIR/step_1 -f json | wc -c
"""

from __future__ import annotations

import sys
import time

import torch

from gradaudit.capture.build import whole, write_rank
from gradaudit.model import ClipRecord


def main(step_dir: str, num_params: int) -> None:
    params = {f"layers.{i}.w": (4,) for i in range(num_params)}
    started = time.perf_counter()
    for rank in range(2):
        write_rank(
            step_dir,
            rank=rank,
            world_size=2,
            step=1,
            params=params,
            pieces=[whole(f"layers.{2 * rank + j}.w", grad=torch.ones(4), stats_only=True) for j in range(2)],
            clip=ClipRecord(max_norm=1.0),
        )
    print(f"built {step_dir} ({num_params:,} parameters listed) in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
