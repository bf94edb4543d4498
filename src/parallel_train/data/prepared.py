"""Prepared data: token shards on disk, read through memory maps, never loaded whole.

`scripts/prepare_data.py` (data/prepare.py) writes a folder:
    prepared.json            the metadata, written last: tokenizer, vocabulary size, dtype, token counts,
                             each shard's size, sha256 and largest token id, the fingerprint of the inputs
    train_000000.bin ...     the train tokens, flat little-endian uint16 (uint32 if the vocabulary needs it)
    val_000000.bin ...       the validation tokens (the last data.val_fraction of the text)
    vocab.json | tokenizer.json   the tokenizer
`train.py data.path=FOLDER` recognizes the folder by prepared.json. Every rank checks the shards' sizes and
recorded largest token ids (with data.verify, also their sha256 and the ids themselves) against it and the
tokenizer's vocabulary, and all ranks compare the hash of their prepared.json with rank 0's: a node with another
or a partial copy stops the run with one line naming the node and the file.

Samples are windows of block_size + 1 tokens at stride block_size (the inputs do not overlap: every token is
a target once per epoch), ordered by data/batch_sampler.py's seeded permutation, which is computed, not stored:
memory per rank is flat from megabytes to tens of billions of tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from parallel_train.config.sections import Config
from parallel_train.core.collectives import all_gather
from parallel_train.data.chat_format import FILES as CHAT_FILES  # the chat template, saved beside the tokenizer
from parallel_train.data.prepared_samples import PreparedSamples, companion_problem
from parallel_train.data.sft import sample_datasets, truncated_away
from parallel_train.data.text import Data, vocab_size_for
from parallel_train.data.tokenizers import Tokenizer, load_saved
from parallel_train.errors import UserError

META = "prepared.json"
FORMAT, VERSION = "parallel-train prepared tokens", 1
SPLITS = ("train", "val")
FULL_HASH_LIMIT = 1 << 30  # data.verify=auto hashes every shard up to this many bytes in all (about a second)
PREPARE_HINT = "prepare it again: python scripts/prepare_data.py --input ... --output {folder}"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def scan_shard(path: Path, dtype: str, chunk: int = 1 << 24) -> tuple[str, int]:
    """(sha256, largest token id) of a shard, in one streamed pass (-1 for an empty shard)."""
    h, top, dt = hashlib.sha256(), -1, np.dtype(dtype).newbyteorder("<")
    with open(path, "rb") as f:
        while data := f.read(chunk):  # chunk is a multiple of every itemsize: no token is cut
            h.update(data)
            top = max(top, int(np.frombuffer(data, dtype=dt).max()))
    return h.hexdigest(), top


def is_prepared(path: str) -> bool:
    """A folder from prepare_data.py, finished or not (an unfinished one is then refused in one line)."""
    folder = Path(path)
    return folder.is_dir() and ((folder / META).is_file() or any(folder.glob("train_*.bin")) or (folder / ".prepare-work").exists())


# ---------------------------------------------------------------- metadata and verification


def read_meta(folder: Path) -> tuple[dict[str, Any], str]:
    """prepared.json and the sha256 of its bytes; a missing or malformed file is a one-line error."""
    path = folder / META
    try:
        raw = path.read_bytes()
        meta = json.loads(raw)
    except FileNotFoundError:
        raise UserError(
            f"data.path: {folder} has no {META} (not prepared, or preparing was interrupted); {PREPARE_HINT.format(folder=folder)}"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"data.path: {path} is not readable JSON ({str(e)[:120]}); {PREPARE_HINT.format(folder=folder)}") from None
    try:
        assert meta["format"] == FORMAT and meta["version"] == VERSION, "format"
        np.dtype(meta["dtype"])
        for split in SPLITS:
            for s in meta["splits"][split]["shards"]:
                assert s["bytes"] == s["tokens"] * np.dtype(meta["dtype"]).itemsize, f"{s['file']} size"
                assert isinstance(s.get("max_id", -1), int), f"{s['file']} max_id"
            assert sum(s["tokens"] for s in meta["splits"][split]["shards"]) == meta["splits"][split]["tokens"], f"{split} tokens"
        assert isinstance(meta["tokenizer"]["fingerprint"], str) and isinstance(meta["tokenizer"]["vocab_size"], int), "tokenizer"
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"data.path: {path} is not a valid {FORMAT} file ({type(e).__name__}: {e}); {PREPARE_HINT.format(folder=folder)}"
        ) from None
    return meta, hashlib.sha256(raw).hexdigest()


def shard_problem(folder: Path, meta: dict[str, Any], full_hash: bool, id_limit: int | None = None) -> str | None:
    """What is wrong with the shards next to prepared.json (missing, truncated, other content, token ids of `id_limit`
    or more: the vocabulary of the tokenizer next to them), or None. The largest id prepared.json records is checked
    always, the ids themselves when the shards are hashed."""
    for split in SPLITS:
        for s in meta["splits"][split]["shards"]:
            path = folder / s["file"]
            if not path.is_file():
                return f"{path} is missing ({META} lists it)"
            size = path.stat().st_size
            if size != s["bytes"]:
                return f"{path} is {size:,} bytes, {META} says {s['bytes']:,} (truncated, or from another preparation)"
            top = s.get("max_id", -1)  # absent in data prepared before it was recorded
            if full_hash:
                sha, top = scan_shard(path, meta["dtype"])
                if sha != s["sha256"]:
                    return f"{path} does not match {META} (its sha256 differs: changed, or from another preparation)"
            if id_limit is not None and top >= id_limit:
                return (
                    f"{path} holds token id {top:,}, beyond the {id_limit:,} ids of the tokenizer next to it "
                    f"(an edited {META} or tokenizer file, or another preparation's shards)"
                )
            if problem := companion_problem(folder, s, full_hash):  # a chat/instruction shard's mask and offsets
                return problem
    return None


def tokenizer_of(folder: Path, meta: dict[str, Any]) -> Tokenizer:
    tokenizer = load_saved(folder)
    if tokenizer is None:
        raise UserError(f"data.path: {folder} has no tokenizer.json or vocab.json; {PREPARE_HINT.format(folder=folder)}")
    if tokenizer.fingerprint != meta["tokenizer"]["fingerprint"]:
        name = "tokenizer.json" if tokenizer.kind == "hf" else "vocab.json"
        raise UserError(f"data.path: {folder / name} does not match {META} (another tokenizer); {PREPARE_HINT.format(folder=folder)}")
    return tokenizer


def wants_full_hash(verify: str, meta: dict[str, Any]) -> bool:
    total = sum(s["bytes"] for split in SPLITS for s in meta["splits"][split]["shards"])
    return verify == "full" or (verify == "auto" and total <= FULL_HASH_LIMIT)


# ---------------------------------------------------------------- every rank and node agree


def node_rank() -> int:
    """This process's node: torchrun's GROUP_RANK (accelerate launch sets it too), else rank // local world size."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int(os.environ.get("RANK", "0")) // max(1, local)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any rank. A collective."""
    return any(all_gather(bool(flag)))


def check_folder(folder: Path, verify: str) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(metadata, its sha256, what is wrong) for this rank's copy of the folder; nothing raised here, so that
    every rank reaches the agreement below."""
    try:
        meta, meta_sha = read_meta(folder)
    except UserError as e:
        return None, None, str(e).removeprefix("data.path: ")
    full = wants_full_hash(verify, meta) and int(os.environ.get("LOCAL_RANK", "0")) == 0  # one hash per node
    try:
        id_limit, tokenizer_problem = tokenizer_of(folder, meta).size, None
    except UserError as e:
        id_limit, tokenizer_problem = None, str(e).removeprefix("data.path: ")
    return meta, meta_sha, shard_problem(folder, meta, full, id_limit) or tokenizer_problem


def agree(folder: Path, meta_sha: str | None, problem: str | None) -> None:
    """Every rank's copy is complete and has rank 0's prepared.json, or every rank raises the same one line. A collective."""
    mine = {
        "node": node_rank(),
        "host": socket.gethostname(),
        "rank": int(os.environ.get("RANK", "0")),
        "path": str(folder / META),
        "meta": meta_sha,
        "problem": problem,
    }
    everyone = all_gather(mine)
    for other in everyone:
        where = f"node {other['node']} ({other['host']}, rank {other['rank']})" if len(everyone) > 1 else ""
        if other["problem"]:
            raise UserError(f"data.path: {where + ': ' if where else ''}{other['problem']}")
        if other["meta"] != everyone[0]["meta"]:
            raise UserError(
                f"data.path: {where}: {other['path']} differs from rank 0's (another preparation); copy the same prepared folder to every node"
            )


# ---------------------------------------------------------------- reading


class TokenShards:
    """The tokens of one split as one sequence over memory-mapped shards (nothing is read until asked for)."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], dtype: str):
        kept = [s for s in shards if s["tokens"] > 0]
        self.paths, self.dtype = [folder / s["file"] for s in kept], np.dtype(dtype).newbyteorder("<")
        self.starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in kept])]).astype(np.int64).tolist()
        self.total = self.starts[-1]
        self._maps: list[np.ndarray] | None = None

    def _open(self) -> list[np.ndarray]:
        if self._maps is None:  # opened lazily in each process (DataLoader workers too)
            # Plain array views of the maps: slicing them skips np.memmap's per-slice bookkeeping.
            self._maps = [np.asarray(np.memmap(p, dtype=self.dtype, mode="r")) for p in self.paths]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:  # pickling must not copy the maps' contents
        return {**self.__dict__, "_maps": None}

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens start .. start + length - 1 (a window may span two shards)."""
        maps, pieces = self._open(), []
        i = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            offset = start - self.starts[i]
            piece = maps[i][offset : offset + length]
            pieces.append(piece)
            start, length, i = start + len(piece), length - len(piece), i + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class PreparedWindows(Dataset):
    """Window i is tokens [i*T, i*T + T + 1): inputs that do not overlap, each token a target once per epoch."""

    def __init__(self, tokens: TokenShards, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (self.tokens.total - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.tokens.read(i * self.block_size, self.block_size + 1).astype(np.int64))
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        windows = torch.from_numpy(np.stack([self.tokens.read(i * T, T + 1) for i in indices]).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


@dataclass
class PreparedInfo:
    folder: Path
    meta: dict[str, Any]
    meta_sha256: str

    def describe(self) -> str:
        t, m = self.meta["tokenizer"], self.meta
        return (
            f"prepared {self.folder}: {m['splits']['train']['tokens']:,} train + {m['splits']['val']['tokens']:,} val tokens in "
            f"{sum(len(m['splits'][s]['shards']) for s in SPLITS)} shards, tokenizer {t['spec']} ({t['vocab_size']:,} ids, {m['dtype']})"
        )


def open_prepared(folder: Path, verify: str) -> PreparedInfo:
    """Read and verify this rank's copy, and agree with every other rank. A collective."""
    meta, meta_sha, problem = check_folder(folder, verify)
    agree(folder, meta_sha, problem)
    assert meta is not None and meta_sha is not None
    return PreparedInfo(folder, meta, meta_sha)


def load_prepared(cfg: Config, saved: Tokenizer | None = None) -> Data:
    """The `Data` of a prepared folder (data.path). `saved`: the tokenizer of the run being resumed. A collective."""
    folder, T = Path(cfg.data.path), cfg.model.block_size
    info = open_prepared(folder, cfg.data.verify)
    tokenizer = tokenizer_of(folder, info.meta)
    if saved is not None and saved.fingerprint != tokenizer.fingerprint:
        raise UserError(
            f"data.path: the resumed run was trained with another tokenizer than {folder}'s ({info.meta['tokenizer']['spec']}); "
            "resume with the data it was trained on, or start a new output_dir"
        )
    vocab_size = vocab_size_for(tokenizer, cfg)
    if info.meta.get("samples") or cfg.data.format != "text":
        return prepared_samples_data(cfg, info, tokenizer, vocab_size)
    splits = info.meta["splits"]
    train = PreparedWindows(TokenShards(folder, splits["train"]["shards"], info.meta["dtype"]), T)
    val = PreparedWindows(TokenShards(folder, splits["val"]["shards"], info.meta["dtype"]), T)
    if len(train) < 1 or len(val) < 1:
        raise UserError(
            f"data.path: {folder} is too short for model.block_size={T}: {splits['train']['tokens']:,} train and "
            f"{splits['val']['tokens']:,} validation tokens, each split needs at least {T + 1}"
        )
    return Data(train, val, tokenizer, vocab_size, order="seeded", description=info.describe(), all_targets_count=True)


def prepared_samples_data(cfg: Config, info: PreparedInfo, tokenizer: Tokenizer, vocab_size: int) -> Data:
    """The `Data` of chat or instruction samples prepared with --format (data/prepared_samples.py): padded or packed
    like the same rows read into memory (data/sft.py), with the chat template saved beside the tokenizer."""
    kind = (info.meta.get("samples") or {}).get("format", "text")
    if kind != cfg.data.format:
        raise UserError(
            f"data.format={cfg.data.format}, but {info.folder} was prepared with --format {kind}; set data.format={kind} "
            f"(or prepare the data again with --format {cfg.data.format})"
        )
    limit, splits = cfg.model.block_size + 1, info.meta["splits"]
    train, val = (PreparedSamples(info.folder, splits[s]["shards"], info.meta["dtype"], limit, cfg.data.truncate) for s in SPLITS)
    if len(train) < 1 or len(val) < 1:
        raise UserError(f"data.path: {info.folder} holds {len(train)} train and {len(val)} validation samples; each split needs one")
    for split, samples in (("train", train), ("validation", val)):  # nothing to learn: data/sft.py's check_learnable
        left, uncut = samples.learnable()
        if not left:
            why = truncated_away(cfg.model.block_size) if uncut else "none of its samples has a token to learn (their masks are all 0)"
            raise UserError(f"data.path: {info.folder} has nothing to learn in its {split} split ({len(samples):,} samples): {why}")
    pad_id = tokenizer.eot if tokenizer.eot is not None else 0
    train_set, val_set = sample_datasets(cfg, train, val, pad_id)
    files = {name: (info.folder / name).read_text(encoding="utf-8") for name in CHAT_FILES if (info.folder / name).is_file()}
    how = (
        f"packed into {len(train_set):,} rows ({100 * train_set.padding_share():.1f}% padding)" if cfg.data.packing else "padded per batch"
    )
    description = f"{info.describe()}; {len(train):,} train + {len(val):,} val {kind} samples, {how}"
    return Data(train_set, val_set, tokenizer, vocab_size, description=description, files=files)
