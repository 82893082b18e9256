"""Synthetic dumps for the benchmark, written with gradaudit's own writer.

Two layouts:
- `write_dense_dump`: full gradients of a transformer-like model sharded FSDP1-style (all parameters
  flattened into one buffer, each rank holding one contiguous range of it), any float dtype;
- `write_stats_dump`: a many-rank stats-only dump, each parameter flat-sharded over every rank
  (FSDP2/ZeRO-style), so each rank holds one piece per parameter and its file holds only metadata.
Both write a consistent clip record (the reported norm is the true norm), so a correct check of them
finds nothing.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

MAX_NORM = 1.0
GRAD_SCALE = 1e-3
"""Gradient values are N(0, 1) * GRAD_SCALE: a norm around 1, so the coefficient is not trivially 1."""


@dataclass(frozen=True, kw_only=True)
class DenseLayout:
    """What `write_dense_dump` wrote: enough for the benchmark to size its targets."""

    directory: Path
    num_ranks: int
    dtype: str
    num_params: int
    num_elements: int
    true_norm: float
    total_bytes: int
    largest_file_bytes: int


@dataclass(frozen=True, kw_only=True)
class StatsLayout:
    directory: Path
    num_ranks: int
    num_params: int
    num_elements: int
    total_bytes: int
    largest_file_bytes: int


# ---------------------------------------------------------------- model shapes


def transformer_shapes(num_elements: int, *, num_layers: int = 8) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a small transformer with about `num_elements` elements in all.

    Per layer 12 h^2 + 2 h (fused qkv, out, up, down, two norms) plus an 8h x h embedding:
    h is solved from the element count and rounded to a multiple of 8.
    """
    hidden = max(8, round(math.sqrt(num_elements / (12 * num_layers + 8)) / 8) * 8)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8 * hidden, hidden)}
    for layer in range(num_layers):
        prefix = f"layers.{layer}."
        shapes[prefix + "attn.qkv.weight"] = (3 * hidden, hidden)
        shapes[prefix + "attn.out.weight"] = (hidden, hidden)
        shapes[prefix + "mlp.up.weight"] = (4 * hidden, hidden)
        shapes[prefix + "mlp.down.weight"] = (hidden, 4 * hidden)
        shapes[prefix + "norm1.weight"] = (hidden,)
        shapes[prefix + "norm2.weight"] = (hidden,)
    return shapes


LLAMA_70B_LAYER = (
    ("self_attn.q_proj.weight", (8192, 8192)),
    ("self_attn.k_proj.weight", (1024, 8192)),
    ("self_attn.v_proj.weight", (1024, 8192)),
    ("self_attn.o_proj.weight", (8192, 8192)),
    ("mlp.gate_proj.weight", (28672, 8192)),
    ("mlp.up_proj.weight", (28672, 8192)),
    ("mlp.down_proj.weight", (8192, 28672)),
    ("input_layernorm.weight", (8192,)),
    ("post_attention_layernorm.weight", (8192,)),
)


def llama_shapes(num_params: int) -> dict[str, tuple[int, ...]]:
    """`num_params` parameters of a Llama-70B-like model: embeddings, final norm, then whole layers
    (the last one cut short). 800 parameters give about 76 billion elements."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (128256, 8192),
        "model.norm.weight": (8192,),
        "lm_head.weight": (128256, 8192),
    }
    layer = 0
    while len(shapes) < num_params:
        for name, shape in LLAMA_70B_LAYER:
            if len(shapes) == num_params:
                break
            shapes[f"model.layers.{layer}.{name}"] = shape
        layer += 1
    return dict(list(shapes.items())[:num_params])


# ---------------------------------------------------------------- dense full dumps


def fsdp1_ranges(shapes: dict[str, tuple[int, ...]], num_ranks: int) -> list[list[tuple[str, int, int]]]:
    """FSDP1-style sharding: the parameters flattened and concatenated in order, the buffer cut into
    `num_ranks` equal contiguous ranges. Returns, per rank, its (param, start, stop) flat ranges."""
    total = sum(math.prod(s) for s in shapes.values())
    per_rank = -(-total // num_ranks)
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(num_ranks)]
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        start = offset
        while start < offset + numel:
            rank = start // per_rank
            stop = min(offset + numel, (rank + 1) * per_rank)
            out[rank].append((name, start - offset, stop - offset))
            start = stop
        offset += numel
    return out


def write_dense_dump(
    directory: Path, *, num_elements: int, num_ranks: int = 8, dtype: str = "float32", seed: int = 0
) -> DenseLayout:
    """Write a full dump of about `num_elements` gradient elements over `num_ranks` FSDP1-style ranks.

    All ranks' gradients are generated first (held in memory) so that every rank can report the true
    norm; then each rank's file is written with `gradaudit.capture.build.write_rank`.
    """
    import torch

    from gradaudit.capture.build import flat, write_rank
    from gradaudit.model import ClipRecord
    from gradaudit.norms import expected_clip_coef

    torch_dtype = getattr(torch, dtype)
    shapes = transformer_shapes(num_elements)
    pool = _value_pool(seed, torch_dtype, num_elements)
    per_rank = []
    sum_sq = 0.0
    for ranges in fsdp1_ranges(shapes, num_ranks):
        pieces = []
        for name, start, stop in ranges:
            values = _values_from_pool(
                pool,
                stop - start,
                offset=(zlib.crc32(name.encode()) + start) % pool.numel(),
                torch_dtype=torch_dtype,
            )
            sum_sq += _sum_sq(values)
            pieces.append(flat(name, start, grad=values))
        per_rank.append(pieces)
    true_norm = math.sqrt(sum_sq)
    clip = ClipRecord(
        max_norm=MAX_NORM, reported_norm=true_norm, clip_coef=expected_clip_coef(true_norm, MAX_NORM)
    )
    sizes = []
    for rank, pieces in enumerate(per_rank):
        path = write_rank(
            directory,
            rank=rank,
            world_size=num_ranks,
            step=1,
            params=shapes,
            pieces=pieces,
            clip=clip,
            run_id="bench",
            host="bench",
            created_at="2026-01-01T00:00:00+00:00",
        )
        sizes.append(path.stat().st_size)
        per_rank[rank] = None  # free as we go
    return DenseLayout(
        directory=directory,
        num_ranks=num_ranks,
        dtype=dtype,
        num_params=len(shapes),
        num_elements=sum(math.prod(s) for s in shapes.values()),
        true_norm=true_norm,
        total_bytes=sum(sizes),
        largest_file_bytes=max(sizes),
    )


POOL_ELEMENTS = (1 << 24) + 7


def _value_pool(seed: int, torch_dtype, num_elements: int):
    """N(0, 1) * GRAD_SCALE values that gradients are cut from: drawing every element with randn
    would take longer than the benchmark itself."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(min(POOL_ELEMENTS, num_elements + 7), generator=generator)
        .mul_(GRAD_SCALE)
        .to(torch_dtype)
    )


def _values_from_pool(pool, numel: int, *, offset: int, torch_dtype):
    import torch

    values = torch.empty(numel, dtype=torch_dtype)
    filled = 0
    while filled < numel:
        take = min(numel - filled, pool.numel() - offset)
        values[filled : filled + take] = pool[offset : offset + take]
        filled += take
        offset = 0
    return values


def _sum_sq(values) -> float:
    import torch

    total = 0.0
    for start in range(0, values.numel(), 1 << 20):
        chunk = values[start : start + (1 << 20)].to(torch.float64)
        total += float(torch.dot(chunk, chunk))
    return total


# ---------------------------------------------------------------- many-rank stats-only dumps


def even_flat_ranges(numel: int, num_ranks: int) -> list[tuple[int, int]]:
    """FSDP2/ZeRO-style: the flattened parameter cut into `num_ranks` ranges of ceil(numel/num_ranks)
    elements (the last ones shorter, possibly empty)."""
    chunk = -(-numel // num_ranks)
    return [(min(numel, r * chunk), min(numel, (r + 1) * chunk)) for r in range(num_ranks)]


def _piece_stats(rng: random.Random, numel: int, scale: float):
    from gradaudit.model import TensorStats

    sum_sq = numel * scale * scale * (0.9 + 0.2 * rng.random())
    return TensorStats(
        numel=numel,
        norm_type=2.0,
        sum_pow=sum_sq,
        sum_sq=sum_sq,
        max_abs=4.0 * scale if numel else 0.0,
        fingerprint=(
            rng.uniform(-1, 1) * scale * math.sqrt(numel),
            rng.uniform(-1, 1) * scale * math.sqrt(numel),
        ),
    )


def write_stats_dump(directory: Path, *, num_ranks: int, num_params: int = 800, seed: int = 0) -> StatsLayout:
    """Write a stats-only dump: `num_params` Llama-70B-like parameters each flat-sharded over all
    `num_ranks` ranks, so every rank file describes `num_params` pieces and holds no tensor.

    Statistics are synthesized (there are no values) and consistent: the clip record's reported norm
    is the norm they add up to. Rank 0 is written by the project's writer (`write_rank_file`: format
    1.1, pieces as binary columns, the parameter table in the step's shared table file); the other
    ranks reuse rank 0's document (naming that table) and columns with their own ranges, statistics
    and rank number patched in (`patched_columns`), which is what lets 4096 files be written in seconds. tests/test_bench_smoke.py checks that both paths
    give identical dumps.
    """
    import json

    from gradaudit.dumpfile.columnar import to_columns
    from gradaudit.dumpfile.paramtable import TABLE_COLUMNS
    from gradaudit.dumpfile.schema import METADATA_KEY
    from gradaudit.dumpfile.writer import write_rank_file

    layout = _stats_rank_dumps(num_ranks=num_ranks, num_params=num_params, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    first = write_rank_file(directory, layout.dump(0), {})
    sizes = [first.stat().st_size]
    from safetensors import safe_open

    with safe_open(str(first), framework="numpy") as handle:
        document = json.loads(handle.metadata()[METADATA_KEY])
    columns = to_columns(layout.dump(0))
    assert columns is not None
    shared = isinstance(document["columnar"]["params"], dict)  # the table is in its own file
    for rank in range(1, num_ranks):
        arrays = layout.patched_columns(columns[1], rank)
        if shared:
            arrays = {k: v for k, v in arrays.items() if k not in TABLE_COLUMNS}
        sizes.append(_write_columns(directory, rank, dict(document, rank=rank), arrays))
    sizes.extend(p.stat().st_size for p in directory.glob("params_*.safetensors"))
    return StatsLayout(
        directory=directory,
        num_ranks=num_ranks,
        num_params=num_params,
        num_elements=layout.num_elements,
        total_bytes=sum(sizes),
        largest_file_bytes=max(sizes),
    )


class _stats_rank_dumps:
    """The synthetic statistics of every rank, and the two ways of turning one rank into a document."""

    def __init__(self, *, num_ranks: int, num_params: int, seed: int) -> None:
        from gradaudit.model import ClipRecord, ParamInfo
        from gradaudit.norms import expected_clip_coef

        self.num_ranks = num_ranks
        self.shapes = llama_shapes(num_params)
        self.infos = tuple(
            ParamInfo(name=n, global_shape=s, dtype="bfloat16") for n, s in self.shapes.items()
        )
        self.num_elements = sum(math.prod(s) for s in self.shapes.values())
        self.ranges = {
            name: even_flat_ranges(math.prod(shape), num_ranks) for name, shape in self.shapes.items()
        }
        scales = {name: GRAD_SCALE * 1e-2 * (1 + (i % 7)) for i, name in enumerate(self.shapes)}
        rng = random.Random(seed)
        self.stats = [
            [
                _piece_stats(rng, self.ranges[n][rank][1] - self.ranges[n][rank][0], scales[n])
                for n in self.shapes
            ]
            for rank in range(num_ranks)
        ]
        true_norm = math.sqrt(math.fsum(s.sum_sq for per_rank in self.stats for s in per_rank))
        self.clip = ClipRecord(
            max_norm=MAX_NORM, reported_norm=true_norm, clip_coef=expected_clip_coef(true_norm, MAX_NORM)
        )

    def dump(self, rank: int):
        """Rank `rank` as a RankDump value, built the ordinary way."""
        from torch import __version__ as torch_version

        from gradaudit.dumpfile.dump import RankDump, as_columns
        from gradaudit.model import FlatRange, Piece
        from gradaudit.version import __version__

        pieces = []
        for index, name in enumerate(self.shapes):
            start, stop = self.ranges[name][rank]
            pieces.append(
                Piece(
                    index=index,
                    param=name,
                    regions=(FlatRange(start=start, stop=stop),),
                    local_shape=(stop - start,),
                    dtype="bfloat16",
                    stats={"grad": self.stats[rank][index]},
                )
            )
        return RankDump(
            path="",
            rank=rank,
            world_size=self.num_ranks,
            step=1,
            mode="stats",
            run_id="bench",
            host="bench",
            torch_version=torch_version,
            gradaudit_version=__version__,
            created_at="2026-01-01T00:00:00+00:00",
            params=self.infos,
            pieces=as_columns(self.infos, pieces),
            clip=self.clip,
        )

    def document(self, rank: int) -> dict:
        from gradaudit.dumpfile.schema import encode_rank

        return encode_rank(self.dump(rank))

    def patched_columns(self, template: dict, rank: int) -> dict:
        """Rank 0's columns with this rank's ranges and statistics."""
        import numpy as np

        from gradaudit.dumpfile.columnar import COORDS, stats_key

        arrays = dict(template)
        arrays[COORDS] = np.array(
            [v for name in self.shapes for v in self.ranges[name][rank]], dtype=np.int64
        )
        arrays[stats_key("grad")] = np.array(
            [[s.sum_pow, s.sum_sq, s.max_abs, *s.fingerprint] for s in self.stats[rank]], dtype=np.float64
        )
        return arrays

    def patched_document(self, template: dict, rank: int) -> dict:
        """`template` (another rank's encoded document) with this rank's number, ranges and statistics."""
        doc = dict(template, rank=rank)
        pieces = []
        for index, (name, piece) in enumerate(zip(self.shapes, template["pieces"], strict=False)):
            start, stop = self.ranges[name][rank]
            stats = self.stats[rank][index]
            encoded = dict(
                piece["stats"]["grad"],
                numel=stats.numel,
                sum_pow=stats.sum_pow,
                sum_sq=stats.sum_sq,
                max_abs=stats.max_abs,
                fingerprint=list(stats.fingerprint),
            )
            pieces.append(
                dict(
                    piece,
                    regions=[{"range": [start, stop]}],
                    local_shape=[stop - start],
                    stats={"grad": encoded},
                )
            )
        doc["pieces"] = pieces
        return doc


def _write_columns(directory: Path, rank: int, doc: dict, arrays: dict) -> int:
    """Write one format-1.1 rank file holding `doc` and its columns, as write_rank_file would."""
    import json

    import torch
    from safetensors.torch import save_file

    from gradaudit.dumpfile.schema import METADATA_KEY
    from gradaudit.dumpfile.writer import rank_file_name

    path = directory / rank_file_name(rank)
    tensors = {key: torch.from_numpy(array.copy()) for key, array in arrays.items()}
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(doc, sort_keys=True, allow_nan=False)})
    return path.stat().st_size


def _write_document(directory: Path, rank: int, doc: dict) -> int:
    """Write one tensor-less rank file holding `doc`, as write_rank_file would; returns its size."""
    import json

    from safetensors.torch import save_file

    from gradaudit.dumpfile.schema import METADATA_KEY
    from gradaudit.dumpfile.writer import rank_file_name

    path = directory / rank_file_name(rank)
    save_file({}, str(path), metadata={METADATA_KEY: json.dumps(doc, sort_keys=True, allow_nan=False)})
    return path.stat().st_size


def write_replicated_stats_dump(
    directory: Path, *, num_shards: int, num_replicas: int, num_params: int = 800
) -> None:
    """HSDP's layout as a stats-only dump: the stats layout of `num_shards` ranks copied onto
    `num_replicas` replica groups (rank r holds what shard r % num_shards holds), every piece in the
    replica group `dp_replicate`, and both process groups (replicate, shard) listed in every file, as
    capture records them. Written rank by rank with the project's writer."""
    import dataclasses

    from gradaudit.dumpfile.dump import as_columns
    from gradaudit.dumpfile.writer import write_rank_file
    from gradaudit.model import Topology

    layout = _stats_rank_dumps(num_ranks=num_shards, num_params=num_params, seed=0)
    world = num_shards * num_replicas
    groups = {
        "dp_replicate": tuple(
            tuple(s + num_shards * k for k in range(num_replicas)) for s in range(num_shards)
        ),
        "dp_shard": tuple(tuple(range(k * num_shards, (k + 1) * num_shards)) for k in range(num_replicas)),
    }
    directory.mkdir(parents=True, exist_ok=True)
    shards = [layout.dump(s) for s in range(num_shards)]
    for rank in range(world):
        shard = shards[rank % num_shards]
        write_rank_file(
            directory,
            dataclasses.replace(
                shard,
                rank=rank,
                world_size=world,
                pieces=as_columns(
                    shard.params,
                    [dataclasses.replace(p, replica_group="dp_replicate") for p in shard.pieces],
                ),
                topology=Topology(groups=groups),
            ),
            {},
        )
