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
import json
import math
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageReader
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from parallel_train import faults
from parallel_train.checkpoint.disk import as_os_error

# A rank's part is cut into files of at most this size: on a GPU each file's tensors are copied to the host before
# it is written, so this bounds a save's extra host memory per rank (on the CPU the tensors are written in place).
FILE_BYTES = 256 * 2**20
# What DCP's safetensors serialisation puts in each file's header, and HuggingFaceStorageReader reads back.
SHARDING_INFO, VERSION = "DCP_SHARDING_INFO", "DCP_VERSION"


def _item_bytes(item) -> int:
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def _files(items: list) -> list[list]:
    """Items in files of at most FILE_BYTES (a larger tensor gets a file of its own)."""
    files: list[list] = [[]]
    size = 0
    for item in items:
        if item.tensor_data is None:
            raise TypeError(f"checkpoint value {item.index.fqn!r} is not a tensor; put it in a JSON file")
        if files[-1] and size + _item_bytes(item) > FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append(item)
        size += _item_bytes(item)
    return [f for f in files if f]


class ShardWriter(FileSystemWriter):
    """DCP's file-system writer, writing each rank's items as safetensors files named by rank (`rank00001-000
    .safetensors`, ...) and no pickled `.metadata`. `written` lists the files this rank wrote (for the manifest).

    The files are what DCP's own safetensors serialisation writes (HuggingFaceStorageReader reads either), written
    here with safetensors' `save_file`, which writes CPU tensors where they lie; torch's writer first serialises a
    whole file into a bytes object, a copy of everything the rank writes."""

    def __init__(self, path: Path):
        super().__init__(path, serialization_format=SerializationFormat.SAFETENSORS, sync_files=True)
        self.written: list[str] = []

    def prepare_global_plan(self, plans):  # the coordinator tells each rank its index
        return [dataclasses.replace(plan, storage_data=rank) for rank, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        results = []
        for i, items in enumerate(_files(plan.items)):
            name = f"rank{plan.storage_data:05d}-{i:03d}.safetensors"
            tensors = {item.index.fqn: planner.resolve_data(item).detach().cpu().contiguous() for item in items}
            offsets = {item.index.fqn: {"saved_offsets": list(item.tensor_data.chunk.offsets)} for item in items}
            metadata = {SHARDING_INFO: json.dumps(offsets), VERSION: "1.0", "format": "pt"}
            path = Path(self.path) / name
            faults.in_shard_write(str(path))  # test-only: a full disk here must stop the run in one line
            try:
                save_file(tensors, str(path), metadata=metadata)
            except (
                SafetensorError
            ) as e:  # a full or failing disk, as an OSError naming the file (checkpoint/checkpointer.py says it in one line)
                raise (as_os_error(e, path) or e) from None
            self.written.append(name)
            results += [WriteResult(item.index, _item_bytes(item), name) for item in items]
        future: Future = Future()
        future.set_result(results)
        return future

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
