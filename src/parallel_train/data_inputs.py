"""The inputs of scripts/prepare_data.py: local files, globs, folders laid out like a Hub dataset, Hub dataset
names, grouped by the `datasets` builder that reads them, each checked before anything is written (an empty
file, one that is not text, a missing text column: one line each).

Text files are read line by line with their line breaks (`sample_by="line", keep_linebreaks=True`): the
rows join back into the exact text, and `datasets.map` can cut a single large file into batches for several
processes. Rows of json/jsonl/csv/parquet files and of Hub datasets are documents.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_train.data import LOCAL_FORMATS, loading_error
from parallel_train.errors import UserError


@dataclass
class Source:
    """One group of inputs that `datasets` reads with one builder: text lines, or documents (rows)."""

    label: str  # what the user gave, for messages
    builder: str  # "text", "json", "csv", "parquet", a folder or a Hub name
    files: list[str] = field(default_factory=list)
    documents: bool = True  # False: lines of one continuous text

    def stamp(self) -> list[Any]:
        """What identifies the inputs cheaply: every file's path, size and modification time (or the Hub name)."""
        if not self.files:
            return [self.builder]
        return [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in self.files]


def _local_files(spec: str) -> list[str]:
    """The files an --input names: a file, a glob, or a folder laid out like a Hub dataset (its train files)."""
    if any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise UserError(f"--input {spec}: no file matches")
        return files
    path = Path(spec)
    if path.is_file():
        return [str(path)]
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(str(path))
        files = [str(f) for f in DataFilesDict.from_patterns(patterns, base_path=str(path)).get("train", [])]
    except Exception:  # datasets: EmptyDatasetError when nothing in the folder looks like data
        files = []
    if not files:
        raise UserError(f"--input {spec}: no data files in this folder (give .txt/.jsonl/.json/.csv/.parquet files)")
    return sorted(files)


def _check_text_file(path: str, label: str) -> None:
    """An empty file, or one that is not UTF-8 text, is a one-line error before anything is read."""
    if os.path.getsize(path) == 0:
        raise UserError(f"--input {label}: {path} is empty")
    if LOCAL_FORMATS.get(Path(path).suffix.lower(), "text") == "parquet":
        return
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sample
            raise UserError(f"--input {label}: {path} is not UTF-8 text (a binary file?)") from None
    if b"\x00" in head:
        raise UserError(f"--input {label}: {path} contains NUL bytes; is it a binary file?")


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Group the inputs by reader: local files by format (in order), Hub names on their own."""
    sources: list[Source] = []
    for spec in inputs:
        path = Path(spec)
        local = path.exists() or any(c in spec for c in "*?[") or path.suffix.lower() in LOCAL_FORMATS or spec.startswith((".", "/", "~"))
        if not local:
            sources.append(Source(spec, spec))  # a Hub dataset name
            continue
        if not path.exists() and not any(c in spec for c in "*?["):
            raise UserError(f"--input {spec}: no such file or folder")
        for f in _local_files(spec):
            fmt = LOCAL_FORMATS.get(Path(f).suffix.lower())
            if fmt is None:
                raise UserError(f"--input {spec}: {f} is not a .txt/.jsonl/.json/.csv/.parquet file")
            _check_text_file(f, spec)
            if sources and sources[-1].builder == fmt and sources[-1].label == spec:
                sources[-1].files.append(f)
            else:
                sources.append(Source(spec, fmt, [f], documents=fmt != "text"))
    return sources


def load_source(src: Source, column: str, cache_dir: Path):
    """The source as a `datasets.Dataset` with one column, `text`."""
    import datasets

    try:
        if src.builder == "text":
            ds = datasets.load_dataset(
                "text", data_files=src.files, split="train", sample_by="line", keep_linebreaks=True, cache_dir=str(cache_dir)
            )
        elif src.files:
            ds = datasets.load_dataset(src.builder, data_files=src.files, split="train", cache_dir=str(cache_dir))
        else:
            ds = datasets.load_dataset(src.builder, split="train")
    except UserError:
        raise
    except Exception as e:
        raise loading_error(e, "--input", src.label) from None
    name = "text" if src.builder == "text" else column
    if name not in ds.column_names:
        raise UserError(f"--text_column: {column!r} is not a column of {src.label!r}; columns: {', '.join(ds.column_names)}")
    ds = ds.select_columns([name])
    return ds.rename_column(name, "text") if name != "text" else ds
