"""Whole weights out of a checkpoint: safetensors files written one tensor at a time, never the whole model at once.

A checkpoint holds each rank's part (checkpoint/storage.py): a tensor may be cut into chunks written by several
ranks. Exporting reads the chunk positions from the safetensors headers, then builds and writes one whole tensor
at a time, so its memory is the largest tensor, not the model, whatever the model's size.

A tied weight (models/ties.py) is stored once, under its owner's name; the export keeps the map of its other names in the
safetensors header (`tied_weights`: json {alias: owner}, and in the index's metadata), and `load_weights` /
`read_weights` give each alias its owner's tensor, so the tied model loads strictly.

Why not torch's own consolidation (torch.distributed.checkpoint._consolidate_hf_safetensors, the same idea): in
torch 2.13 it writes zeros for 0-d tensors (a scalar parameter or buffer) and fails on integer dtypes
(`torch.finfo`), and it keeps the checkpoint's key prefixes; this module is the same streaming copy without those.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from parallel_train.checkpoint.manifest import SHARD_DIR
from parallel_train.checkpoint.named_state import MODEL
from parallel_train.checkpoint.storage import SHARDING_INFO
from parallel_train.core.json_text import json_text
from parallel_train.models.ties import TIED_KEY, ties_from_metadata, with_aliases

INDEX = "model.safetensors.index.json"  # the Hugging Face name for a sharded model's weight map
# The safetensors dtype names (https://huggingface.co/docs/safetensors/index#format) and their torch dtypes.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass
class Chunk:
    path: Path
    key: str  # the name inside that file
    offsets: list[int]  # where it starts in the whole tensor


@dataclass
class Entry:
    """One whole tensor of the export: its dtype, shape and the chunks it is made of."""

    dtype: str
    shape: list[int]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def index_files(files: list[Path], prefix: str = "") -> dict[str, Entry]:
    """The tensors whose keys start with `prefix` (dropped in the result), from the files' headers only."""
    entries: dict[str, Entry] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            info = json.loads((f.metadata() or {}).get(SHARDING_INFO, "{}"))
            for key in f.keys():
                if not key.startswith(prefix):
                    continue
                piece = f.get_slice(key)
                shape, offsets = piece.get_shape(), info.get(key, {}).get("saved_offsets") or [0] * len(piece.get_shape())
                entry = entries.setdefault(key[len(prefix) :], Entry(piece.get_dtype(), [0] * len(shape)))
                entry.shape = [max(a, o + s) for a, o, s in zip(entry.shape, offsets, shape, strict=True)]
                entry.chunks.append(Chunk(path, key, offsets))
    return entries


def whole_tensor(entry: Entry) -> torch.Tensor:
    """The whole tensor, assembled from its chunks (each read from its file, nothing else)."""
    full = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    covered = 0
    for chunk in entry.chunks:
        with safe_open(str(chunk.path), framework="pt") as f:
            piece = f.get_tensor(chunk.key)
        full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, piece.shape, strict=True))] = piece
        covered += piece.numel()
    if covered != full.numel():
        raise ValueError(f"the chunks of a tensor of shape {entry.shape} hold {covered} of its {full.numel()} values")
    return full


def write_safetensors(path: Path, entries: dict[str, Entry], ties: dict[str, str] | None = None) -> None:
    """A safetensors file of `entries` (name order), streamed: the header first, then one whole tensor at a time;
    `ties` ({alias: owner}) go into its metadata. Written to `path.tmp`, then renamed, so a kill never leaves half
    a file under the final name."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **({TIED_KEY: json.dumps(ties, sort_keys=True)} if ties else {})}}
    begin = 0
    for name, entry in sorted(entries.items()):
        header[name] = {"dtype": entry.dtype, "shape": entry.shape, "data_offsets": [begin, begin + entry.nbytes]}
        begin += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensor data starts 8-byte aligned, as safetensors itself writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for _, entry in sorted(entries.items()):
            out.write(whole_tensor(entry).reshape(-1).view(torch.uint8).numpy().tobytes())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def checkpoint_weights(checkpoint: Path) -> dict[str, Entry]:
    """The model's weights in a checkpoint, by canonical name: from its shards, or a whole model.safetensors
    (checkpoints written before sharded saves)."""
    if (checkpoint / SHARD_DIR).is_dir():
        return index_files(sorted((checkpoint / SHARD_DIR).glob("*.safetensors")), prefix=MODEL)
    return index_files([checkpoint / "model.safetensors"])


def checkpoint_ties(checkpoint: Path) -> dict[str, str]:
    """The tied names ({alias: owner}) a checkpoint records (optimizer.json), or a whole model.safetensors (its header)."""
    if (checkpoint / "optimizer.json").is_file():
        return json.loads((checkpoint / "optimizer.json").read_text()).get("tied", {})
    if (checkpoint / "model.safetensors").is_file():
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
            return ties_from_metadata(f.metadata())
    return {}


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint (or of a folder's model.safetensors) in memory, every alias of a tied weight
    given its owner's tensor (for sampling from a small model, and tests)."""
    weights = {name: whole_tensor(entry) for name, entry in checkpoint_weights(checkpoint).items()}
    return with_aliases(weights, checkpoint_ties(checkpoint))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, with the aliases its header records (`load_file` and the tied names)."""
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        ties = ties_from_metadata(f.metadata())
    return with_aliases(load_file(str(path)), ties)


def export(checkpoint: Path, out_dir: Path, max_file_bytes: int | None = None) -> list[Path]:
    """Write the checkpoint's weights into `out_dir`: `model.safetensors`, or, past `max_file_bytes`, shards
    `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` (Hugging Face's layout)."""
    entries, ties = checkpoint_weights(checkpoint), checkpoint_ties(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, Entry]] = [{}]
    for name, entry in sorted(entries.items()):
        if max_file_bytes and groups[-1] and sum(e.nbytes for e in groups[-1].values()) + entry.nbytes > max_file_bytes:
            groups.append({})
        groups[-1][name] = entry
    if len(groups) == 1:
        write_safetensors(out_dir / "model.safetensors", entries, ties)
        return [out_dir / "model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups, strict=True):
        write_safetensors(out_dir / name, group, ties)
    weight_map = {tensor: name for name, group in zip(names, groups, strict=True) for tensor in group}
    metadata = {"total_size": sum(e.nbytes for e in entries.values()), **({TIED_KEY: ties} if ties else {})}
    (out_dir / INDEX).write_text(json_text({"metadata": metadata, "weight_map": weight_map}, indent=2))
    return [out_dir / n for n in names] + [out_dir / INDEX]
