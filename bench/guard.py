"""The guard's cost in a realistic step: a transformer of >= 30M parameters, >= 1024 tokens per rank,
2 gloo ranks under DDP and FSDP2, AdamW, torch's clip_grad_norm_.

    python bench/guard.py                 # the figures of bench/RESULTS.md (a few minutes)
    python bench/guard.py --tiny          # a smoke run of every section

Within one run, steps without the guard (paused: no hook), checked by the guard, and with the guard
attached but the step not checked come in a shuffled order each round (the same on both ranks), so the
three medians share the machine's load and no kind keeps a place in the round. The
guard's own measuring (its per-group norms and the coefficient's samples, what it adds to a step
besides its one all-gather and the verdict) is timed against one `torch._foreach_norm` over the same
local gradients, the reference the stack's own clip computes.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 8192
"""Full size: vocab 8192, width 512, 8 layers of FFN 2048: 33.6M parameters."""


def _model(*, width: int, layers: int, vocab: int) -> torch.nn.Module:
    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
                for _ in range(layers)
            )
            self.head = torch.nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens)
            for layer in self.layers:
                hidden = layer(hidden)
            return self.head(hidden)

    torch.manual_seed(0)
    return LM()


def _wrap(model: torch.nn.Module, stack: str, world_size: int) -> torch.nn.Module:
    if stack == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        for p in model.parameters()
        if p.grad is not None
    ]


def _measure(
    guard: Any,
    model: torch.nn.Module,
    own: list,
    reference: list,
    accessors: list,
    order: random.Random,
    clock: Any = time.perf_counter,
    weights: list | None = None,
) -> None:
    """The guard's own measuring on the final gradients as a checked step does it (its group terms and
    the coefficient's two samples of the elements read with them), against the stack's own norm pass over the same local gradients; and the same measuring
    through the pieces' own gradient accessors (DTensor.to_local() per parameter: the guard before it
    read `_local_tensor`). The three in a shuffled order (the same on both ranks), timed by `clock`."""
    summary = guard._summary
    fast = summary._readers
    through_accessors = tuple(piece.grad for piece in summary.pieces)

    def timed(kind: str) -> float:
        if kind == "reference":
            grads = _local_grads(model)
            start = clock()
            torch._foreach_norm(grads, 2.0)
            return clock() - start
        summary._readers = fast if kind == "own" else through_accessors
        start = clock()
        _, _, sampled = summary.measure()  # as a checked step: the terms and the sample before the clip,
        summary.sample(sampled)  # and the same elements after it
        elapsed = clock() - start
        summary._readers = fast
        return elapsed

    def weight_check() -> float:
        start = clock()
        summary.weight_terms()  # the replicas' weights, every weights_every checked steps
        return clock() - start

    kinds = ["reference", "own", "accessors"]
    order.shuffle(kinds)
    times = {kind: timed(kind) for kind in kinds}
    reference.append(times["reference"])
    own.append(times["own"])
    accessors.append(times["accessors"])
    if weights is not None:
        weights.append(weight_check())


def _time_own_hooks(guard_class: Any, spent: list[float], clock: Any = time.perf_counter) -> None:
    """Add to spent[0] the time by `clock` (wall time by default) inside the guard's own hooks (its work
    around each clip call and before and after the optimizer step, the collective included), the
    outermost call only: the clip and the optimizer step themselves are not in it."""
    depth = [0]
    for name in ("_before_call", "_record_call", "_before_step", "_after_step"):

        def timed(self: Any, *args: Any, _original: Any = getattr(guard_class, name), **kwargs: Any) -> Any:
            depth[0] += 1
            start = clock()
            try:
                return _original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += clock() - start

        setattr(guard_class, name, timed)


def _worker(rank: int, world_size: int, port: int, config: dict, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        import gradaudit
        from gradaudit.live.guard import Guard

        spent = [0.0]
        _time_own_hooks(Guard, spent)  # this rank process's own copy of the class
        out = Path(config["out_dir"]) / config["stack"]
        model = _wrap(_model(**config["model"]), config["stack"], world_size)
        params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its global one
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(rank)
        seq, batch = config["seq"], config["batch"]
        times: dict[str, list[float]] = {"none": [], "guard": [], "attached": []}
        in_guard: list[float] = []  # the guard's own time in each checked step
        own: list[float] = []
        reference: list[float] = []
        accessors: list[float] = []
        weights: list[float] = []
        clip_own: list[float] = []
        clips: dict[str, list[float]] = {"none": [], "guard": [], "attached": []}

        def step() -> float:
            tokens = torch.randint(0, config["model"]["vocab"], (batch, seq + 1), generator=gen)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            clip_start, guard_before = time.perf_counter(), spent[0]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            # the clip call less the guard's measuring inside it: torch's own work (see live/lending.py)
            clip_own.append(time.perf_counter() - clip_start - (spent[0] - guard_before))
            opt.step()
            return time.perf_counter() - start

        guard = gradaudit.guard(model, max_norm=1.0, optimizer=opt, out_dir=out)
        for _ in range(config["warmup"]):  # the guard's first verdict imports the analysis
            step()
        never = 1 << 60  # every=never: attached, but no step is checked
        order = random.Random(0)  # the same order on both ranks: they step together
        clock = time.thread_time if config["clock"] == "thread" else time.perf_counter
        for _ in range(config["rounds"]):
            kinds = ["none", "guard", "attached"] * 2
            order.shuffle(kinds)  # no kind keeps a place in the round (load varies with time)
            for kind in kinds:
                if kind == "none":
                    guard.pause()
                guard.every = 1 if kind == "guard" else never
                before = spent[0]
                times[kind].append(step())
                clips[kind].append(clip_own[-1])
                if kind == "guard":
                    in_guard.append(spent[0] - before)
                guard.resume()
            _measure(guard, model, own, reference, accessors, order, clock, weights)
        for _ in range(config["repeats"]):
            _measure(guard, model, own, reference, accessors, order, clock, weights)
        anomalies = list(guard.anomalies)
        guard.remove()
        assert not anomalies, f"a correct run was flagged: {anomalies}"
        results[rank] = {
            "params": params,
            "tokens": batch * seq,
            "times": times,
            "clips": clips,
            "in_guard": in_guard,
            "own": own,
            "reference": reference,
            "accessors": accessors,
            "weights": weights,
            "weights_every": guard.weights_every,
        }
    finally:
        dist.destroy_process_group()


def _run_stack(stack: str, config: dict) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, port, {**config, "stack": stack}, results), nprocs=2, join=True)
    return dict(results)


def _quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:.3f}..{high:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run: a small model, two rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--stacks", default="ddp,fsdp2")
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="measure the guard's own cost this many more times after the rounds (with --rounds 0: "
        "only that, which a loaded machine can still resolve: each ratio is taken within one repeat)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="what times the guard's own measuring: wall time, or the rank's CPU time (time.thread_time: "
        "what other processes take of a shared machine's cores does not count)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        config = {
            "model": {"width": 32, "layers": 1, "vocab": 64},
            "seq": 16,
            "batch": 2,
            "rounds": 2,
            "warmup": 1,
            "repeats": args.repeats,
            "clock": args.clock,
        }
    else:
        config = {
            "model": {"width": 512, "layers": 8, "vocab": VOCAB},
            "seq": 512,
            "batch": 2,
            "rounds": args.rounds,
            "warmup": 2 if args.rounds else 1,
            "repeats": args.repeats,
            "clock": args.clock,
        }
    with tempfile.TemporaryDirectory() as out_dir:
        config["out_dir"] = out_dir
        for stack in args.stacks.split(","):
            results = _run_stack(stack, config)
            first = results[0]
            print(
                f"== {stack}: {first['params'] / 1e6:.1f}M parameters, {first['tokens']} tokens per rank, 2 gloo ranks"
            )
            for rank in sorted(results):
                r = results[rank]
                own, ref = statistics.median(r["own"]), statistics.median(r["reference"])
                if r["times"]["none"]:
                    none, guard, attached = (
                        statistics.median(r["times"][k]) for k in ("none", "guard", "attached")
                    )
                    print(
                        f"rank {rank}: step median without {none:.3f} s, guard checking {guard:.3f} s, "
                        f"attached unchecked {attached:.3f} s"
                    )
                    for kind in ("none", "guard", "attached"):
                        print(f"  {kind:>8}: " + " ".join(f"{t:.2f}" for t in r["times"][kind]))
                    print(f"RATIO {stack} rank {rank} step guard/none = {guard / none:.4f}")
                    print(f"RATIO {stack} rank {rank} step attached/none = {attached / none:.4f}")
                    own_step = statistics.median(r["in_guard"])
                    print(
                        f"RATIO {stack} rank {rank} guard's own time in a checked step/step without = "
                        f"{own_step / none:.4f} ({own_step * 1e3:.1f} ms in its hooks; target <= 0.01)"
                    )
                    lent, paused = (statistics.median(r["clips"][k]) for k in ("guard", "none"))
                    print(
                        f"RATIO {stack} rank {rank} the clip call's own time checked/paused = "
                        f"{lent / paused:.3f} ({lent * 1e3:.2f} / {paused * 1e3:.2f} ms: checked, torch's "
                        "clip takes the guard's norm pass where its gradients are the guard's)"
                    )
                print(
                    f"rank {rank}: measuring {own * 1e3:.2f} ms (through the accessors "
                    f"{statistics.median(r['accessors']) * 1e3:.2f} ms) vs _foreach_norm {ref * 1e3:.2f} ms, "
                    f"medians of {len(r['own'])}"
                )
                if r["weights"] and r["times"]["none"]:
                    check, every = statistics.median(r["weights"]), r["weights_every"]
                    none = statistics.median(r["times"]["none"])
                    print(
                        f"RATIO {stack} rank {rank} weight check/step without = {check / none:.4f} per check, "
                        f"{check / every / none:.5f} amortised over weights_every={every} "
                        f"({check * 1e3:.1f} ms a check; target amortised <= 0.01)"
                    )
                for kind in ("own", "accessors"):
                    ratios = sorted(t / f for t, f in zip(r[kind], r["reference"], strict=True))
                    spread = f"quartiles {_quartiles(ratios)}, range {ratios[0]:.3f}..{ratios[-1]:.3f}"
                    print(
                        f"RATIO {stack} rank {rank} measuring{'' if kind == 'own' else ' through the accessors'}"
                        f"/_foreach_norm = {statistics.median(ratios):.3f} (per repeat: {spread})"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
