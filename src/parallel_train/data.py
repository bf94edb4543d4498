"""Data: load a corpus with Hugging Face `datasets`, tokenize, split, and shard batches across ranks.

The rule that makes every topology train on the same data: the samples of optimizer step k depend only
on the seed and the global batch size (batch_size x world_size x gradient_accumulation_steps). One
seeded permutation per epoch orders all samples (as `DistributedSampler` does); global batch k is the
next slice of it, cut into one contiguous piece per (micro-step, rank). So 2 ranks x batch 4,
1 rank x batch 8 and 4 micro-steps x batch 2 see the same 8 samples at every step, and resuming at
step k needs nothing but k.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from parallel_train.config import Config, DataConfig
from parallel_train.errors import UserError

LOCAL_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


# ---------------------------------------------------------------- corpus and vocabulary


def load_corpus(cfg: DataConfig) -> str:
    """Read the whole corpus as one string through `datasets` (local file or Hub dataset)."""
    import datasets  # lazy: costs about 1.7 s, and the random/synthetic data need none of it

    datasets.disable_progress_bars()
    path = Path(cfg.path)
    try:
        if path.is_dir():  # a dataset folder laid out like a Hub repo (e.g. from `hf download --repo-type dataset`)
            ds = datasets.load_dataset(str(path), split="train")
        elif path.suffix.lower() in LOCAL_FORMATS or path.exists():
            if not path.is_file():
                raise UserError(f"data.path: no such file {cfg.path!r} (give a .txt/.json/.jsonl/.csv/.parquet file)")
            fmt = LOCAL_FORMATS.get(path.suffix.lower(), "text")
            if fmt == "text":
                ds = datasets.load_dataset("text", data_files=str(path), split="train", sample_by="document")
            else:
                ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(cfg.path, split="train")
    except UserError:
        raise
    except UnicodeDecodeError:
        raise UserError(f"data.path: {cfg.path!r} is not UTF-8 text (a binary file?)") from None
    except (ConnectionError, OSError, ValueError, FileNotFoundError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"data.path: could not load {cfg.path!r} ({first})") from None
    except Exception as e:  # datasets raises its own error types for malformed json/csv/parquet
        if isinstance(e.__cause__ or e.__context__, UnicodeDecodeError):  # datasets wraps the decode error
            raise UserError(f"data.path: {cfg.path!r} is not UTF-8 text (a binary file?)") from None
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"data.path: could not read {cfg.path!r} ({type(e).__name__}: {first})") from None
    column = cfg.text_column
    if column not in ds.column_names:
        raise UserError(f"data.text_column: {cfg.text_column!r} is not a column of {cfg.path!r}; columns: {', '.join(ds.column_names)}")
    text = "\n".join(str(t) for t in ds[column] if t is not None)
    if "\x00" in text:
        raise UserError(f"data.path: {cfg.path!r} contains NUL bytes; is it a binary file?")
    return text


@dataclass
class CharVocab:
    """Character vocabulary built from the corpus (sorted, so the same corpus gives the same ids)."""

    chars: list[str]
    kind = "char"  # a class attribute, not a field

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(sorted(set(text)))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(max(map(ord, self.chars)) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        ids = table[np.minimum(codes, len(table) - 1)]
        if (ids < 0).any() or (codes >= len(table)).any():
            raise ValueError("text holds characters outside the vocabulary")
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> str:
        return json.dumps({"kind": "char", "chars": self.chars}, ensure_ascii=False)

    @classmethod
    def load(cls, path: Path) -> CharVocab:
        return cls(json.loads(path.read_text())["chars"])


class ByteVocab:
    """One id per UTF-8 byte (data.tokenizer=byte): any text encodes, nothing to build or to save but the kind."""

    kind, size = "byte", 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # padded ids have no byte

    def to_json(self) -> str:
        return json.dumps({"kind": "byte"})


def load_vocab(path: Path) -> CharVocab | ByteVocab:
    """The vocabulary a run saved in vocab.json, whichever tokenizer made it."""
    return ByteVocab() if json.loads(path.read_text()).get("kind") == "byte" else CharVocab.load(path)


# ---------------------------------------------------------------- datasets


class TokenWindows(Dataset):
    """Every window of block_size + 1 tokens: sample i is (ids[i:i+T], ids[i+1:i+T+1])."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.ids) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i : i + self.block_size + 1]
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # One gather for the whole batch instead of B slices and a stack.
        windows = self.ids[torch.as_tensor(indices).unsqueeze(1) + self._offsets]
        return windows[:, :-1], windows[:, 1:]


class RandomClassification(Dataset):
    """Random inputs and labels: the classic seed example's data (e.g. 64 x 10 inputs, 10 classes)."""

    def __init__(self, num_samples: int, in_features: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_features, generator=g)
        self.y = torch.randint(0, num_classes, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def keep_batch(batch):
    """collate_fn for datasets whose __getitems__ already returns a batch."""
    return batch


# ---------------------------------------------------------------- sharding


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices for each micro-step, from `start_step` on, forever.

    Stream position p holds sample perm_e[p % N] with e = p // N (one seeded permutation per epoch).
    Micro-step m of the run covers stream positions [m*W*B, (m+1)*W*B); rank r takes the r-th slice of B.
    """

    def __init__(self, num_samples: int, batch_size: int, world_size: int, rank: int, seed: int, start_micro_step: int = 0):
        self.n, self.batch_size, self.world_size, self.rank, self.seed = num_samples, batch_size, world_size, rank, seed
        self.start_micro_step = start_micro_step
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def indices_at(self, micro_step: int) -> list[int]:
        start = (micro_step * self.world_size + self.rank) * self.batch_size
        out: list[int] = []
        pos = start
        while pos < start + self.batch_size:  # a batch may straddle two epochs
            epoch, offset = divmod(pos, self.n)
            take = min(self.n - offset, start + self.batch_size - pos)
            out.extend(self._permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        m = self.start_micro_step
        while True:
            yield self.indices_at(m)
            m += 1


# ---------------------------------------------------------------- assembly


@dataclass
class Data:
    train_set: Dataset
    val_set: Dataset
    vocab: CharVocab | ByteVocab | None  # None for data without a vocabulary (random, synthetic)
    vocab_size: int
    # Turns a list of samples into the (inputs, targets) batch the engine expects. None: the datasets
    # above batch themselves (__getitems__); any other dataset gets torch's default_collate.
    collate: Callable[[list], tuple[torch.Tensor, torch.Tensor]] | None = None


def collate_fn(data: Data, dataset: Dataset) -> Callable:
    if data.collate is not None:
        return data.collate
    return keep_batch if hasattr(dataset, "__getitems__") else default_collate


def build_datasets(cfg: Config, vocab: CharVocab | ByteVocab | None = None) -> Data:
    """Load and split the data. Pass the saved vocab when resuming so ids stay the same."""
    d, m = cfg.data, cfg.model
    if d.source != "text":  # a loader of your own, registered in data_sources.py
        from parallel_train.data_sources import DATA_SOURCES  # late: data_sources imports this module

        return DATA_SOURCES[d.source](cfg, vocab)
    if d.path == "random":
        train = RandomClassification(d.num_samples, m.in_features, m.out_features, seed=cfg.train.seed)
        val = RandomClassification(d.num_samples, m.in_features, m.out_features, seed=cfg.train.seed + 1)
        return Data(train, val, None, m.out_features)

    if d.path == "synthetic":
        return synthetic_data(cfg)

    text = load_corpus(d)
    if not text:
        raise UserError(f"data.path: {d.path!r} is empty")
    if vocab is not None and vocab.kind != d.tokenizer:
        raise UserError(f"data.tokenizer: the resumed run used the {vocab.kind} tokenizer; resume with data.tokenizer={vocab.kind}")
    vocab = vocab or (ByteVocab() if d.tokenizer == "byte" else CharVocab.from_text(text))
    try:
        ids = torch.from_numpy(vocab.encode(text))
    except ValueError:
        raise UserError(
            f"data.path: {d.path!r} has characters missing from the resumed run's vocab.json; resume with the corpus it was trained on"
        ) from None
    n_val = int(len(ids) * d.val_fraction)
    train_ids, val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    need = m.block_size + 2
    if len(val_ids) < need or len(train_ids) < need:
        raise UserError(
            f"data.path: {d.path!r} is too short: {len(ids)} tokens give {len(val_ids)} validation tokens, "
            f"need at least {need} for model.block_size={m.block_size}; use a longer corpus or a smaller block_size"
        )
    vocab_size = max(vocab.size, m.vocab_size)
    return Data(TokenWindows(train_ids, m.block_size), TokenWindows(val_ids, m.block_size), vocab, vocab_size)


def synthetic_data(cfg: Config) -> Data:
    """Uniformly random token ids (data.path=synthetic): speed benchmarks with no download and no tokenizer.

    The loss stays near ln(vocab_size): there is nothing to learn. The vocabulary is model.vocab_size
    (or 256, the byte vocabulary); the train split holds data.num_samples tokens (at least two windows).
    """
    d, m = cfg.data, cfg.model
    vocab_size = m.vocab_size or ByteVocab.size
    g = torch.Generator().manual_seed(cfg.train.seed)
    n_train = max(d.num_samples, m.block_size + 2)
    n_val = max(int(n_train * d.val_fraction), m.block_size + 2)
    ids = torch.randint(0, vocab_size, (n_train + n_val,), generator=g)
    return Data(TokenWindows(ids[:n_train], m.block_size), TokenWindows(ids[n_train:], m.block_size), None, vocab_size)


def train_loader(data: Data, cfg: Config, world_size: int, rank: int, start_step: int, pin_memory: bool) -> DataLoader:
    """This rank's batches from optimizer step `start_step` on (never ends; the loop counts steps)."""
    sampler = GlobalBatchSampler(
        len(data.train_set),
        cfg.train.batch_size,
        world_size,
        rank,
        cfg.train.seed,
        start_micro_step=start_step * cfg.train.gradient_accumulation_steps,
    )
    # Its own generator: creating the iterator must not draw from the global RNG (dropout's), or a
    # resumed run would drift from an uninterrupted one.
    return DataLoader(
        data.train_set,
        batch_sampler=sampler,
        collate_fn=collate_fn(data, data.train_set),
        num_workers=cfg.data.num_workers,
        pin_memory=pin_memory,
        persistent_workers=cfg.data.num_workers > 0,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )


def val_loader(data: Data, cfg: Config) -> DataLoader:
    """A fixed set of eval.iters x eval.batch_size validation samples, the same at every evaluation and topology.

    Not sharded here: `accelerator.prepare` shards it, and `gather_for_metrics` drops the samples it
    repeats to even out the last batch, so every sample counts exactly once.
    """
    batch_size = cfg.eval.batch_size or cfg.train.batch_size
    n_eval = cfg.eval.iters * batch_size
    g = torch.Generator().manual_seed(cfg.train.seed + 7919)
    n = len(data.val_set)
    indices = torch.randperm(n, generator=g)[:n_eval] if n >= n_eval else torch.randint(0, n, (n_eval,), generator=g)
    subset = torch.utils.data.Subset(data.val_set, indices.tolist())
    return DataLoader(
        subset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_fn(data, data.val_set),
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
