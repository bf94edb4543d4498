"""Chat and instruction samples on disk (scripts/prepare_data.py --format chat|instruction): written once, read
through memory maps.

A prepared folder of samples holds, per split, shards of whole samples; each shard is three files:
    train_000000.bin          the samples' token ids one after the other (uint16 or uint32, as for text)
    train_000000.mask.bin     one byte per token: 1 where the model learns to write it (the assistant's tokens)
    train_000000.offsets.bin  int64 where each sample starts, and the end of the last one (samples + 1 numbers)
prepared.json lists each shard with its token and sample counts and the size and sha256 of all three files, and
names the format (`samples`: chat or instruction, and the chat template used, saved beside the tokenizer). The
mask is the one data/chat_format.py computes at training time, so a prepared set trains exactly like the same rows
read into memory, and starts in seconds whatever its size: nothing is read until a sample is asked for.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.data.packing import learnable_tokens
from parallel_train.errors import UserError

MASK, OFFSETS = ".mask.bin", ".offsets.bin"


def companion(shard_file: str, suffix: str) -> str:
    """`train_000000.bin` -> `train_000000.mask.bin` (or `.offsets.bin`)."""
    return shard_file.removesuffix(".bin") + suffix


def _write(path: Path, data: bytes) -> dict[str, Any]:
    """Written as NAME.tmp, flushed, renamed; returns its record for prepared.json."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class SampleShardWriter:
    """One split's samples as shards of whole samples, at most `shard_tokens` tokens each (one longer sample is a
    shard of its own)."""

    def __init__(self, folder: Path, names, dtype: str, shard_tokens: int):
        """`names(index)`: the file name of the split's shard `index` (prepared_data.shard_name)."""
        self.folder, self.names, self.dtype, self.limit = folder, names, np.dtype(dtype).newbyteorder("<"), shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._learnable = 0  # the shard's targets the loss counts (prepared.json: read at start instead of every mask)

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self._ids and sum(map(len, self._ids)) + len(ids) > self.limit:
            self._flush()
        self._ids.append(np.asarray(ids))
        self._masks.append(np.asarray(mask, dtype=np.uint8))
        self._learnable += learnable_tokens(mask)

    def _flush(self) -> None:
        name = self.names(len(self.shards))
        ids = np.concatenate(self._ids).astype(self.dtype)
        offsets = np.concatenate([[0], np.cumsum([len(i) for i in self._ids])]).astype("<i8")
        record = _write(self.folder / name, ids.tobytes())
        record.update(tokens=len(ids), samples=len(self._ids), max_id=int(ids.max()) if len(ids) else -1, learnable=self._learnable)
        record["mask"] = _write(self.folder / companion(name, MASK), np.concatenate(self._masks).tobytes())
        record["offsets"] = _write(self.folder / companion(name, OFFSETS), offsets.tobytes())
        self.shards.append(record)
        self._ids, self._masks, self._learnable = [], [], 0

    def finish(self) -> list[dict[str, Any]]:
        if self._ids:
            self._flush()
        return self.shards


def companion_problem(folder: Path, shard: dict[str, Any], full_hash: bool) -> str | None:
    """What is wrong with a shard's mask and offsets files (missing, another size, other content), or None."""
    for kind in ("mask", "offsets"):
        rec = shard.get(kind)
        if rec is None:
            continue
        path = folder / rec["file"]
        if not path.is_file():
            return f"{path} is missing (prepared.json lists it)"
        if path.stat().st_size != rec["bytes"]:
            return f"{path} is {path.stat().st_size:,} bytes, prepared.json says {rec['bytes']:,} (truncated, or from another preparation)"
        if full_hash and hashlib.sha256(path.read_bytes()).hexdigest() != rec["sha256"]:
            return f"{path} does not match prepared.json (its sha256 differs: changed, or from another preparation)"
    return None


class PreparedSamples:
    """The samples of one split, memory-mapped (data/packing.py's Samples): `get(i)` reads sample i only. A sample longer
    than `limit` ids is cut to it (data.truncate), or refused when the split is opened."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], dtype: str, limit: int, truncate: bool):
        self.folder, self.dtype, self.limit = folder, np.dtype(dtype).newbyteorder("<"), limit
        self.shards = [s for s in shards if s.get("samples")]
        self._maps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self.starts = np.concatenate([[0], np.cumsum([s["samples"] for s in self.shards])]).astype(np.int64).tolist()
        lengths = np.concatenate([np.diff(self._open_one(s)[2]) for s in self.shards]) if self.shards else np.zeros(0, np.int64)
        too_long = np.flatnonzero(lengths > limit)
        if len(too_long) and not truncate:
            i = int(too_long[0])
            raise UserError(
                f"data.path: sample {i:,} of {folder} is {int(lengths[i]):,} tokens, longer than model.block_size + 1 = {limit:,} "
                f"({len(too_long):,} samples are); raise model.block_size, or cut them with data.truncate=true"
            )
        self.lengths = np.minimum(lengths, limit)
        self._too_long = too_long  # cut to `limit` on read (data.truncate)

    def learnable(self) -> tuple[int, int]:
        """The split's targets the loss counts, after and before data.truncate's cut: prepared.json's count (per shard),
        less what the cut removes (only the cut samples are read); a shard prepared before the count was recorded is
        counted from its mask (one byte a token)."""
        total = 0
        for shard in self.shards:
            if "learnable" in shard:
                total += int(shard["learnable"])
                continue
            _, mask, offsets = self._open_one(shard)
            starts = offsets[:-1][np.diff(offsets) > 0]  # each sample's first token is no target
            total += int(np.count_nonzero(mask)) - int(np.count_nonzero(mask[starts]))
        cut_away = sum(int(np.count_nonzero(self._mask_of(int(i))[self.limit :])) for i in self._too_long)
        return total - cut_away, total

    def _open_one(self, shard: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens = np.asarray(np.memmap(self.folder / shard["file"], dtype=self.dtype, mode="r"))
        mask = np.asarray(np.memmap(self.folder / shard["mask"]["file"], dtype=np.uint8, mode="r"))
        offsets = np.asarray(np.memmap(self.folder / shard["offsets"]["file"], dtype="<i8", mode="r"))
        return tokens, mask, offsets

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the maps
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return self.starts[-1]

    def _span(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int, int]:
        """Sample i's shard maps and where it lies in them, uncut."""
        if self._maps is None:
            self._maps = [self._open_one(s) for s in self.shards]
        k = bisect.bisect_right(self.starts, i) - 1
        offsets = self._maps[k][2]
        return self._maps[k], int(offsets[i - self.starts[k]]), int(offsets[i - self.starts[k] + 1])

    def _mask_of(self, i: int) -> np.ndarray:
        (_, mask, _), lo, hi = self._span(i)
        return mask[lo:hi].astype(bool)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        (tokens, mask, _), lo, hi = self._span(i)
        hi = min(hi, lo + self.limit)
        return tokens[lo:hi].astype(np.int64), mask[lo:hi].astype(bool)
