"""Each rank's part of a checkpoint as safetensors files, written and read by torch.distributed.checkpoint (DCP).

DCP plans the writes: every rank writes the tensors it holds (its FSDP2/TP shards, its pipeline stages), a tensor
replicated on several ranks (DDP, or the step counters under FSDP2) is written by one of them, with the bytes
balanced over ranks; loading reads whatever slice each rank needs from whichever files hold it, so N ranks'
checkpoint loads on M ranks, under another engine (DCP reshards).

The files are DCP's safetensors serialization: each file's header records where each chunk sits in its whole
tensor (`DCP_SHARDING_INFO`), and torch's HuggingFaceStorageReader rebuilds DCP's metadata from those headers.
Why not DCP's defaults: FileSystemWriter pickles the metadata into a `.metadata` file and FileSystemReader reads
it with `pickle.load`, which runs whatever code a planted file holds. Here no `.metadata` is written and none is
read: safetensors is a JSON header and raw bytes, so nothing in a checkpoint can execute.

Every value must be a tensor: DCP would pickle anything else (BYTE_IO items), and safetensors cannot hold it.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageReader
from torch.distributed.checkpoint.filesystem import SerializationFormat

# A rank's part is cut into files of at most this size: the writer holds one file's bytes in memory at a time
# (safetensors serialises a whole file at once), so this bounds a save's extra host memory per rank.
FILE_BYTES = 256 * 2**20


def _item_bytes(item) -> int:
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


class ShardWriter(FileSystemWriter):
    """DCP's file-system writer with safetensors files named by rank (`rank00001-000.safetensors`, ...) and no
    pickled `.metadata`. `written` lists the files this rank wrote (for the manifest)."""

    def __init__(self, path: Path):
        super().__init__(path, serialization_format=SerializationFormat.SAFETENSORS, sync_files=True, thread_count=1)
        self.written: list[str] = []

    def prepare_global_plan(self, plans):  # the coordinator tells each rank its index
        return [dataclasses.replace(plan, storage_data=rank) for rank, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        files: list[list] = [[]]
        size = 0
        for item in plan.items:
            if item.tensor_data is None:
                raise TypeError(f"checkpoint value {item.index.fqn!r} is not a tensor; put it in a JSON file")
            if files[-1] and size + _item_bytes(item) > FILE_BYTES:
                files.append([])
                size = 0
            files[-1].append(item)
            size += _item_bytes(item)
        work: queue.Queue = queue.Queue()
        for i, items in enumerate(f for f in files if f):
            name = f"rank{plan.storage_data:05d}-{i:03d}.safetensors"
            self.written.append(name)
            work.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, work)  # torch's own writer loop (what HuggingFaceStorageWriter calls too)

    def finish(self, metadata, results) -> None:
        """Nothing: the metadata lives in the files' safetensors headers (the default pickles it to `.metadata`)."""


@contextmanager
def _quiet_in_one_process():
    """DCP warns on every call without a process group that it assumes one process: that is exactly the case then.
    (catch_warnings swaps the global filter list; the training thread, the only other one, does not change it.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def write(folder: Path, tensors: dict[str, torch.Tensor], group=None) -> list[str]:
    """Write this rank's tensors into `folder` (a collective over `group`). Returns the files this rank wrote."""
    writer = ShardWriter(folder)
    with _quiet_in_one_process():
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not dist.is_initialized())
    return writer.written


def saved_tensors(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor in the checkpoint: its whole shape and dtype (from the safetensors headers only)."""
    metadata = HuggingFaceStorageReader(str(folder)).read_metadata()
    return {k: (m.size, m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}


def read(folder: Path, templates: dict[str, torch.Tensor]) -> None:
    """Fill `templates` (this rank's tensors, DTensor shards included) from the checkpoint. A collective."""
    with _quiet_in_one_process():
        dcp.load(templates, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not dist.is_initialized())
