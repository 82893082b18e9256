"""The guard's host work per checked step counted in instructions (valgrind's callgrind), not timed.

    python bench/guard_instructions.py          # 16 and 1,000 parameter tensors, world size 1
    python bench/guard_instructions.py --tiny   # a smoke run

On a shared VM the timed figures of bench/guard_fixed.py move by 2x from one minute to the next; the
count of instructions the host executes does not (0.05% between runs). Each model (Linear 8x8 layers,
as guard_fixed.py's) runs in a process of its own under callgrind, counting only the measured steps
(instrumentation is switched on after the warm-up, with callgrind_control): once with the guard
checking every step, once with the guard paused (torch's clip makes its own norm pass then). Printed:
the checked step's instructions over the paused step's, and their difference per step, the guard's
net work. It counts work, not time: cache misses, the other rank's share of a core and waiting are
not in it. Skipped where valgrind is not installed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_STEPS = """
import os, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch
import gradaudit

torch.set_num_threads(1)
tensors, steps, mode = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(tensors // 2)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 8)
params = list(model.parameters())


def step():
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(params, 1e-3)
    opt.step()


def count(on):
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True)


with tempfile.TemporaryDirectory() as out:
    guard = gradaudit.guard(model, max_norm=1e-3, optimizer=opt, out_dir=out)
    for _ in range(10):
        step()
    if mode == "paused":
        guard.pause()
    count(True)
    for _ in range(steps):
        step()
    count(False)
    guard.resume()
    anomalies = list(guard.anomalies)
    guard.remove()
assert not anomalies, anomalies
"""


def _instructions(tensors: int, steps: int, mode: str, work: Path) -> int:
    """The instructions of `steps` steps of the model, checked or paused, counted by callgrind."""
    out = work / f"callgrind.{tensors}.{mode}.out"
    script = work / "steps.py"
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            "-q",
            os.path.realpath(sys.executable),
            str(script),
            str(REPO),
            str(tensors),
            str(steps),
            mode,
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    totals = re.search(r"^totals:\s*(\d+)", out.read_text(), re.M)
    if totals is None:
        raise RuntimeError(f"no totals line in {out}")
    return int(totals.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 16 tensors, 5 steps")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("SKIP valgrind is not installed: no instruction counts")
        return
    runs = [(16, 5)] if args.tiny else [(16, 100), (1000, 20)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "steps.py").write_text(_STEPS)
        jobs = {(tensors, steps, mode) for tensors, steps in runs for mode in ("checked", "paused")}
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            counted = {job: pool.submit(_instructions, *job, work) for job in sorted(jobs)}
            found = {job: future.result() for job, future in counted.items()}
    for tensors, steps in runs:
        checked, paused = found[(tensors, steps, "checked")], found[(tensors, steps, "paused")]
        print(
            f"RATIO host instructions per step, checked / paused, {tensors} tensors world 1 = "
            f"{checked / paused:.3f} (the guard's net: {(checked - paused) / steps / 1000:+.0f}k "
            f"instructions a step; a paused step {paused / steps / 1e6:.2f}M; {steps} steps each)"
        )


if __name__ == "__main__":
    main()
