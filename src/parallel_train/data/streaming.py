"""Streamed data (data.streaming=true): read documents as they come, tokenize on the fly, never hold the corpus.

For data too big to prepare, or a Hub dataset: data.path is a folder of jsonl/json/csv/parquet/txt files (laid
out like a Hub dataset) or a Hub dataset name. `datasets` streams it (`load_dataset(..., streaming=True)`) and
`split_dataset_by_node` gives each data-parallel rank its own part (whole files when their number divides
evenly, else every world-th document). Each rank packs its documents, each followed by the tokenizer's
end-of-text token (a newline for char and byte), into windows of block_size + 1 tokens at stride block_size,
in order: a stream is not shuffled (datasets' shuffle buffer is not part of its saved state, so a resumed run
would differ); shuffle the files beforehand, or prepare the data.

Validation: the dataset's validation (or test) split, else its last file; the first eval.iters x
eval.batch_size windows of it, the same on every rank.

Position: after every batch the stream can say where it is (`state_dict`: the datasets stream's own state
before the current document, plus the tokens of that document already used). The trainer saves every
data-parallel rank's position in each checkpoint (tensor-parallel and pipeline ranks of one replica read the same
stream and share it), so a resumed run with the same number of data-parallel ranks continues exactly where the
killed one stopped. What holds and what does not: docs/data.md#streaming.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from parallel_train.config.sections import Config
from parallel_train.core.collectives import all_gather
from parallel_train.data.inputs import LOCAL_FORMATS, loading_error
from parallel_train.data.text import Data, check_resumed_tokenizer, train_loader, vocab_size_for
from parallel_train.data.tokenizers import Tokenizer, load_tokenizer, needs_corpus
from parallel_train.errors import UserError

VAL_SPLITS = ("validation", "valid", "val", "test")


class StreamWindows:
    """Windows of T + 1 tokens at stride T from a stream of documents, batched, with a resumable position."""

    def __init__(
        self,
        make_stream: Callable[[], Any],
        tokenizer: Tokenizer,
        documents: bool,
        column: str,
        block_size: int,
        batch_size: int,
        what: str = "this rank's part of the stream",  # for the error when it holds no text
        files: list[str] | None = None,  # the local files streamed, searched for a malformed row when reading fails
    ):
        self.make_stream, self.tokenizer, self.documents, self.column, self.what = make_stream, tokenizer, documents, column, what
        self.files = files or []
        self.T, self.B = block_size, batch_size
        self.epoch, self._saved, self._skip = 0, None, 0  # where the next pass starts
        self._docs: Iterator | None = None
        self.buf = np.empty(0, dtype=np.int64)  # tokens from the current position on
        self.marks: deque = deque()  # (epoch, stream state before a document, where it starts in buf; <= 0 for the first)

    # -- position
    def state_dict(self) -> dict[str, Any]:
        """Where the next window starts: (epoch, the stream's state before that document, tokens of it already used)."""
        if not self.marks:
            return {"epoch": self.epoch, "stream": self._saved, "skip": self._skip}
        epoch, stream, start = self.marks[0]
        return {"epoch": epoch, "stream": stream, "skip": -start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._saved, self._skip = int(state["epoch"]), state["stream"], int(state["skip"])
        self._docs, self.buf, self.marks = None, np.empty(0, dtype=np.int64), deque()

    # -- reading
    def _encode(self, text: str) -> np.ndarray:
        tok = self.tokenizer
        if self.documents and tok.eot is not None:
            return np.append(tok.encode(text), tok.eot)
        if self.documents and not text.endswith("\n"):
            text += "\n"
        return tok.encode(text)

    def _documents(self) -> Iterator[tuple[int, Any, np.ndarray, int]]:
        """(epoch, stream state before a document, its ids not used yet, how many were used), pass after pass;
        the first pass starts at the saved position."""
        while True:
            stream, produced = self.make_stream(), False
            if self._saved is not None:
                stream.load_state_dict(self._saved)
            # Until it is iterated, a datasets stream reports its initial state, not a loaded one.
            before = self._saved if self._saved is not None else stream.state_dict()
            for row in self._rows(stream):
                if self.column not in row:  # a json stream says its columns only when read
                    raise UserError(f"data.text_column: {self.column!r} is not a column of the stream; columns: {', '.join(row)}")
                text = row[self.column]
                if text is not None:
                    used, self._skip = self._skip, 0  # after a resume, the first document's first tokens were used already
                    yield self.epoch, before, self._encode(str(text))[used:], used
                    produced = True
                before = stream.state_dict()
            if not produced and self._saved is None:
                raise UserError(f"data.path: {self.what} holds no text in data.text_column={self.column!r}")
            self.epoch, self._saved, self._skip = self.epoch + 1, None, 0

    def _rows(self, stream: Any) -> Iterator[dict[str, Any]]:
        """The stream's rows; a file that cannot be read (a malformed json row) is one line, not a traceback mid-run."""
        rows = iter(stream)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:
                raise loading_error(e, "data.path", self.what, self.files) from None
            yield row

    def _pull(self) -> None:
        if self._docs is None:
            self._docs = self._documents()
        epoch, state, ids, used = next(self._docs)
        self.marks.append((epoch, state, len(self.buf) - used))
        self.buf = np.concatenate([self.buf, ids.astype(np.int64)])

    def window(self) -> np.ndarray:
        """The next T + 1 tokens; the position moves on by T."""
        while len(self.buf) < self.T + 1:
            self._pull()
        out = self.buf[: self.T + 1]
        self.buf = self.buf[self.T :]
        self.marks = deque((e, s, start - self.T) for e, s, start in self.marks)
        while len(self.marks) > 1 and self.marks[1][2] <= 0:  # the first document is used up
            self.marks.popleft()
        return out

    def __iter__(self) -> StreamWindows:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.from_numpy(np.stack([self.window() for _ in range(self.B)]))
        return windows[:, :-1], windows[:, 1:]


class FixedWindows(Dataset):
    """A fixed set of windows (the validation set of a stream), held as one tensor."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows[i, :-1], self.windows[i, 1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.windows[torch.as_tensor(indices)]
        return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------- opening the stream


def split_files(folder: Path) -> tuple[str, list[str], list[str]]:
    """(format, train files, validation files) of a folder: its validation/test split, else its last file."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # datasets: EmptyDatasetError when nothing looks like data
        found = {}
    train = sorted(str(f) for f in found.get("train", []))
    val = next((sorted(str(f) for f in found[s]) for s in VAL_SPLITS if s in found), [])
    if not val and len(train) >= 2:
        train, val = train[:-1], train[-1:]
    if not train or not val:
        raise UserError(
            f"data.path: {folder} needs data files for training and for validation (a validation-*.jsonl file, or at least two files: "
            "the last one validates)"
        )
    formats = {LOCAL_FORMATS.get(Path(f).suffix.lower()) for f in train + val}
    if len(formats) != 1 or None in formats:
        raise UserError(f"data.path: {folder} mixes file types or holds files other than .txt/.jsonl/.json/.csv/.parquet")
    return formats.pop(), train, val


def open_splits(cfg: Config) -> tuple[Any, Any, bool, list[str]]:
    """(train stream, validation stream, rows are documents, the local files) for data.path, through `datasets` streaming."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(cfg.data.path)
    try:
        if path.is_dir():
            fmt, train, val = split_files(path)
            kwargs = {"sample_by": "line", "keep_linebreaks": True} if fmt == "text" else {}
            splits = datasets.load_dataset(fmt, data_files={"train": train, "validation": val}, streaming=True, **kwargs)
            return splits["train"], splits["validation"], fmt != "text", train + val
        if path.exists():
            raise UserError(f"data.path: {path} is a file; data.streaming=true reads a folder of files or a Hub dataset")
        splits = datasets.load_dataset(cfg.data.path, streaming=True)
    except UserError:
        raise
    except Exception as e:
        raise loading_error(e, "data.path", cfg.data.path) from None
    val_name = next((s for s in VAL_SPLITS if s in splits), None)
    if "train" not in splits or val_name is None:
        raise UserError(
            f"data.path: {cfg.data.path!r} needs a train and a validation (or test) split to stream; its splits: {', '.join(splits)}"
        )
    return splits["train"], splits[val_name], True, []


def column_of(stream: Any, documents: bool, cfg: Config) -> str:
    if not documents:
        return "text"
    names = stream.column_names
    if names is not None and cfg.data.text_column not in names:
        raise UserError(f"data.text_column: {cfg.data.text_column!r} is not a column of {cfg.data.path!r}; columns: {', '.join(names)}")
    return cfg.data.text_column


def rank_stream(stream: Any, world: int, rank: int) -> Any:
    """A fresh copy of `stream` (loading a position into a datasets stream sticks to the object), this rank's part."""
    from datasets.distributed import split_dataset_by_node

    fresh = copy.deepcopy(stream)
    return split_dataset_by_node(fresh, rank=rank, world_size=world) if world > 1 else fresh


def stream_tokenizer(cfg: Config, saved: Tokenizer | None) -> Tokenizer:
    spec = cfg.data.tokenizer
    if saved is not None:
        check_resumed_tokenizer(saved, spec)
        return saved  # a resumed run keeps its ids
    if needs_corpus(spec):
        raise UserError(
            f"data.tokenizer={spec} is built from the whole corpus, which a stream never holds; give byte, a tokenizer.json or "
            "folder (e.g. one scripts/prepare_data.py trained on a sample), or a Hub tokenizer"
        )
    return load_tokenizer(spec)


def load_stream(cfg: Config, saved: Tokenizer | None = None) -> Data:
    """The `Data` of a stream: the validation windows in memory, and a factory for each rank's train batches."""
    tokenizer = stream_tokenizer(cfg, saved)
    vocab_size = vocab_size_for(tokenizer, cfg)
    train, val, documents, files = open_splits(cfg)
    column = column_of(train, documents, cfg)
    n_eval = cfg.eval.iters * (cfg.eval.batch_size or cfg.train.batch_size)
    what = f"the validation split of {cfg.data.path!r}"
    reader = StreamWindows(partial(rank_stream, val, 1, 0), tokenizer, documents, column, cfg.model.block_size, 1, what, files)
    windows = []
    while len(windows) < n_eval and reader.epoch == 0:
        windows.append(reader.window())
    if reader.epoch > 0:  # the window that crossed into a second pass repeats the start
        windows = windows[:-1]
    if not windows:
        raise UserError(f"data.path: {what} is shorter than model.block_size + 1 tokens")

    def train_stream(world: int, rank: int, position: dict[str, Any] | None) -> StreamWindows:
        batches = StreamWindows(
            partial(rank_stream, train, world, rank), tokenizer, documents, column, cfg.model.block_size, cfg.train.batch_size, files=files
        )
        if position is not None:
            batches.load_state_dict(position)
        return batches

    described = (
        f"streaming {cfg.data.path} ({'documents' if documents else 'text lines'}), tokenizer {cfg.data.tokenizer} ({tokenizer.size:,} ids)"
    )
    return Data(
        None,
        FixedWindows(torch.from_numpy(np.stack(windows))),
        tokenizer,
        vocab_size,
        train_stream=train_stream,
        description=described,
        all_targets_count=True,
    )


# ---------------------------------------------------------------- positions in checkpoints


def gather_positions(batches: Any, dp_size: int, dp_rank: int) -> dict[str, Any] | None:
    """Every data-parallel rank's stream position, for the checkpoint (None when the data is not a stream). The ranks
    of one tensor-parallel group or pipeline read the same stream and share its position. A collective."""
    if not hasattr(batches, "state_dict"):
        return None
    return positions_by_dp_rank(all_gather((dp_rank, batches.state_dict())), dp_size)


def positions_by_dp_rank(pairs: list[tuple[int, dict[str, Any]]], dp_size: int) -> dict[str, Any]:
    """{"dp_size", "ranks": the position of data-parallel rank 0, 1, ...} from every process's (dp rank, position)."""
    by_rank: dict[int, dict[str, Any]] = {}
    for dp_rank, position in pairs:
        by_rank.setdefault(dp_rank, position)
    return {"dp_size": dp_size, "ranks": [by_rank[r] for r in range(dp_size)]}


def position_for(saved: dict[str, Any] | None, dp_size: int, dp_rank: int) -> tuple[dict[str, Any] | None, str | None]:
    """(this data-parallel rank's saved stream position, a notice when it cannot continue exactly). Checkpoints written
    before positions were keyed by data-parallel rank say `world_size`: their processes were the data-parallel ranks."""
    if not saved:
        return None, None
    saved_size = saved.get("dp_size", saved.get("world_size"))
    if saved_size != dp_size:
        return None, (
            f"notice: the stream positions were saved by {saved_size} data-parallel ranks, this run has {dp_size}: each rank's "
            "part of the stream differs, so the stream starts again from its beginning"
        )
    return saved["ranks"][dp_rank], None


def resumed_loader(
    data: Data, cfg: Config, dp_size: int, dp_rank: int, start_step: int, pin_memory: bool, saved: Any, say: Callable[[str], None]
):
    """The training loader from `start_step` on, a stream from this data-parallel rank's saved position (`saved`: the
    checkpoint's `data_position`); says when a stream saved by another number of data-parallel ranks cannot continue
    exactly."""
    position, notice = position_for(saved, dp_size, dp_rank)
    if notice:
        say(notice)
    return train_loader(data, cfg, dp_size, dp_rank, start_step, pin_memory, stream_state=position)
