"""The inputs of scripts/prepare_data.py and of a `data.path` folder: local files, globs, folders laid out like a
Hub dataset, Hub dataset names, grouped by the `datasets` builder that reads them, each checked before anything is
written (an empty file, one that is not text, a file of another kind in a folder, a missing text column: one line
each, naming the option or key they came from: `--input X` or `data.path=X`).

Text files are read line by line with their line breaks, and a line longer than PIECE_CHARS characters is cut
into pieces of at most that many (`text_pieces`): the rows join back into the exact text, `datasets.map` can cut
a single large file into batches for several processes, and a file without line breaks prepares in the same
memory as any other (a 21 MB line took 3.3 GB with a BPE when it was one row, 0.46 GB in pieces). Rows of json/jsonl/csv/parquet files and
of Hub datasets are documents.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_train.errors import UserError

LOCAL_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
KINDS = ".txt/.jsonl/.json/.csv/.parquet"
# The longest row a text file is read as. A longer line is cut before its last space in the second half of this
# many characters (at the limit when there is none): char and byte ids are those of the whole text, and a BPE
# splits a word at a cut only in a stretch of 512 characters without a space. With map batches of 1000 rows, a
# batch holds at most 1 MB of text, whatever the lines.
PIECE_CHARS = 1 << 10


def not_text(values: list) -> int | None:
    """The index of the first value that is a dict or a list (a struct or a sequence column), which would be read as
    its Python repr; None when every value is text, a number (its text: a csv column of numbers) or missing."""
    return next((i for i, v in enumerate(values) if isinstance(v, (dict, list))), None)


def loading_error(e: Exception, key: str, what: str, files: list[str] | tuple[str, ...] = ()) -> UserError:
    """One line for an error `datasets` raised while loading `what` (named by config key or option `key`); when a
    json file among `files` holds a malformed row, the line names that file and row."""
    if (row := bad_json_row(files)) is not None:
        return UserError(f"{key}: {row}; fix or remove that row")
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if isinstance(e, UnicodeDecodeError) or isinstance(e.__cause__ or e.__context__, UnicodeDecodeError):  # datasets wraps it
        return UserError(f"{key}: {what!r} is not UTF-8 text (a binary file?)")
    if isinstance(e, (ConnectionError, OSError, ValueError)):
        return UserError(f"{key}: could not load {what!r} ({first})")
    # datasets raises its own error types for malformed json/csv/parquet
    return UserError(f"{key}: could not read {what!r} ({type(e).__name__}: {first})")


def bad_json_row(files: list[str] | tuple[str, ...]) -> str | None:
    """'FILE: the row on line N is not ...' for the first malformed row of the json files among `files`, or None.
    Read line by line, and only after `datasets` failed: pyarrow's own message counts rows within a block of the
    file, not from its start."""
    for file in files:
        if LOCAL_FORMATS.get(Path(file).suffix.lower()) != "json":
            continue
        try:
            with open(file, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        if number == 1 and file.endswith(".json"):  # one JSON document over many lines, not JSON Lines
                            break
                        return f"{file}: the row on line {number} is not valid JSON ({getattr(e, 'msg', e)})"
                    if not isinstance(row, dict):
                        return f'{file}: the row on line {number} is not a JSON object ({{"text": ...}})'
        except (OSError, UnicodeDecodeError):  # unreadable or not text: the caller's message says so
            continue
    return None


def named(key: str, spec: str) -> str:
    """How messages name an input: `--input X` for prepare_data.py's option, `data.path=X` for a config key."""
    return f"{key} {spec}" if key.startswith("--") else f"{key}={spec}"


@dataclass
class Source:
    """One group of inputs that `datasets` reads with one builder: text lines, or documents (rows)."""

    label: str  # what the user gave, for messages
    builder: str  # "text", "json", "csv", "parquet", a folder or a Hub name
    files: list[str] = field(default_factory=list)
    documents: bool = True  # False: lines of one continuous text
    key: str = "--input"  # the option or config key that named it, for messages

    def stamp(self) -> list[Any]:
        """What identifies the inputs cheaply: every file's path, size and modification time (or the Hub name)."""
        if not self.files:
            return [self.builder]
        return [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in self.files]


def _local_files(spec: str, key: str) -> list[str]:
    """The files an input names: a file, a glob, or a folder laid out like a Hub dataset (its train files; datasets
    leaves out its README.md, the dataset card, and hidden files)."""
    if any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise UserError(f"{named(key, spec)}: no file matches")
        return files
    path = Path(spec)
    if path.is_file():
        return [str(path)]
    files = folder_splits(path).get("train", [])
    if not files:
        raise UserError(f"{named(key, spec)}: no data files in this folder (give {KINDS} files)")
    return files


def folder_splits(folder: Path) -> dict[str, list[str]]:
    """The data files of a folder laid out like a Hub dataset, by split, as `datasets` splits them (train.jsonl,
    validation.jsonl, dev.csv, ...; a folder of files named otherwise is all train), sorted; {} for none."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(str(folder))
        found = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    except Exception:  # datasets: EmptyDatasetError when nothing in the folder looks like data
        return {}
    return {str(split): sorted(str(f) for f in files) for split, files in found.items()}


def _check_text_file(path: str, where: str) -> None:
    """An empty file, or one that is not UTF-8 text, is a one-line error before anything is read."""
    if os.path.getsize(path) == 0:
        raise UserError(f"{where}: {path} is empty")
    if LOCAL_FORMATS.get(Path(path).suffix.lower(), "text") == "parquet":
        return
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sample
            raise UserError(f"{where}: {path} is not UTF-8 text (a binary file?)") from None
    if b"\x00" in head:
        raise UserError(f"{where}: {path} contains NUL bytes; is it a binary file?")


def resolve_inputs(inputs: list[str], key: str = "--input") -> list[Source]:
    """Group the inputs by reader: local files by format (in order), Hub names on their own. A file of a kind no
    builder reads (in a folder or a glob: a .bin, a .md) is a one-line error, never skipped in silence."""
    sources: list[Source] = []
    for spec in inputs:
        path, where = Path(spec), named(key, spec)
        local = path.exists() or any(c in spec for c in "*?[") or path.suffix.lower() in LOCAL_FORMATS or spec.startswith((".", "/", "~"))
        if not local:
            sources.append(Source(spec, spec, key=key))  # a Hub dataset name
            continue
        if not path.exists() and not any(c in spec for c in "*?["):
            raise UserError(f"{where}: no such file or folder")
        for f in _local_files(spec, key):
            fmt = LOCAL_FORMATS.get(Path(f).suffix.lower())
            if fmt is None:
                raise UserError(f"{where}: {f} is not a {KINDS} file; move it out of the folder")
            _check_text_file(f, where)
            if sources and sources[-1].builder == fmt and sources[-1].label == spec:
                sources[-1].files.append(f)
            else:
                sources.append(Source(spec, fmt, [f], documents=fmt != "text", key=key))
    return sources


def load_source(src: Source, column: str, cache_dir: Path | None, column_key: str = "--text_column"):
    """The source as a `datasets.Dataset` with one column, `text` (a text file's lines, line breaks kept)."""
    import datasets

    cache = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    try:
        if src.builder == "text":  # the stamps make the cache key: a changed file is read again
            features = datasets.Features({"text": datasets.Value("string")})
            pieces = {"stamps": src.stamp(), "piece": PIECE_CHARS}
            ds = datasets.Dataset.from_generator(text_pieces, features=features, gen_kwargs=pieces, **cache)
        elif src.files:
            ds = datasets.load_dataset(src.builder, data_files=src.files, split="train", **cache)
        else:
            ds = datasets.load_dataset(src.builder, split="train")
    except UserError:
        raise
    except Exception as e:
        raise loading_error(e, src.key, src.label, src.files) from None
    name = "text" if src.builder == "text" else column
    if name not in ds.column_names:
        raise UserError(f"{column_key}: {column!r} is not a column of {src.label!r}; columns: {', '.join(ds.column_names)}")
    ds = ds.select_columns([name])
    return ds.rename_column(name, "text") if name != "text" else ds


def row_datasets(inputs: list[str], key: str, text_refusal: str = "") -> list[tuple[str, Any]]:
    """(label, datasets.Dataset with every column) for each file of `inputs` (named by `key` in messages; a Hub dataset
    is one, labelled by its name), rows in file order. A text file is rows of its lines (column `text`), unless
    `text_refusal` names why rows are needed (e.g. "data.format=chat"): then it is a one-line error."""
    import datasets

    datasets.disable_progress_bars()
    out = []
    for src in resolve_inputs(inputs, key=key):
        if src.builder == "text" and text_refusal:
            raise UserError(f"{text_refusal}: {', '.join(src.files)} is text, not rows; give .jsonl/.json/.csv/.parquet files")
        for files in [[f] for f in src.files] or [[]]:
            try:
                ds = (
                    datasets.load_dataset(src.builder, data_files=files, split="train")
                    if files
                    else datasets.load_dataset(src.builder, split="train")
                )
            except Exception as e:
                raise loading_error(e, key, src.label, files) from None
            out.append((files[0] if files else src.label, ds))
    return out


def text_pieces(stamps: list[list[Any]], piece: int) -> Iterator[dict[str, str]]:
    """Rows {"text": ...} of text files (`Source.stamp()`: [path, size, mtime] each): every line with its line break,
    a longer one in pieces of at most `piece` characters (never more than that is read at once)."""
    for path, *_ in stamps:
        with open(path, encoding="utf-8") as f:
            rest = ""
            while chunk := rest + f.readline(piece - len(rest)):
                rest = ""
                if len(chunk) == piece and not chunk.endswith("\n"):  # part of a longer line
                    cut = chunk.rfind(" ", piece // 2)  # the space starts the next piece, as a BPE's word does
                    if cut > 0:
                        chunk, rest = chunk[:cut], chunk[cut:]
                yield {"text": chunk}


def describe_folder(folder: Path, sources: list[Source], shown: int = 3) -> str:
    """What a folder's sources read, and which of its files they left out (a dataset card, another split), in a line."""

    def names(paths: list[str]) -> str:
        rel = [Path(p).resolve().relative_to(folder.resolve()).as_posix() for p in paths]
        return ", ".join(rel[:shown]) + (f" and {len(rel) - shown} more" if len(rel) > shown else "")

    read = [f"{len(s.files)} {s.builder} file{'s' * (len(s.files) > 1)} ({names(s.files)}) {'as documents' if s.documents else 'as one text'}"
            for s in sources]  # fmt: skip
    used = {Path(f).resolve() for s in sources for f in s.files}
    left = [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and p.resolve() not in used
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)]  # fmt: skip
    return f"{folder}: read {'; '.join(read)}" + (f"; skipped {names(left)} (not data files of the train split)" if left else "")
