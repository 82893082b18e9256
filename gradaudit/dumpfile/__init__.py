"""The dump format: schema, writer and loader."""

from .loader import find_step_dirs, load_rank_file, load_step
from .reader import TensorReader
from .writer import DumpExistsError, rank_file_name, step_dir, tensor_key, write_rank_file

__all__ = [
    "DumpExistsError",
    "TensorReader",
    "find_step_dirs",
    "load_rank_file",
    "load_step",
    "rank_file_name",
    "step_dir",
    "tensor_key",
    "write_rank_file",
]
