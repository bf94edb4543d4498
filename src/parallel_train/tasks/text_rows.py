"""What the text tasks share (sequence_classification.py, token_classification.py, masked_lm.py, seq2seq.py): rows
read from data.path, the columns a task reads from them, the train/validation split, the run's tokenizer, and
encodings of one fixed length (model.block_size) served as dict batches.

data.path is a jsonl/json/csv/parquet file (a .txt file: one row per line, in a column `text`), a folder of them
laid out like a Hub dataset (train.jsonl, validation.jsonl, ...: data/inputs.py), a folder written by `datasets`'
save_to_disk (a Dataset, or a DatasetDict), or a Hub dataset name. The validation rows are the folder's validation
split when it has one, else the last data.val_fraction of the rows, in file order (as data.format=chat splits its
rows, data/sft.py): the same on every rank and at every launch.

Every row is tokenized once, at start (in-memory data: some hundreds of MB of rows), at model.block_size. Each batch
is then cut to its longest row, rounded up to a multiple of 8, as the scripts' collators pad; where the layout needs
one shape for every batch (pipeline stages, torch.compile, tensor parallel: `fixed_shapes`), every batch stays
model.block_size long. The banner's data line says which.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from parallel_train.data.inputs import folder_splits, loading_error, not_text, resolve_inputs, row_datasets
from parallel_train.data.packing import ALIGN
from parallel_train.data.text import Data, check_resumed_tokenizer, vocab_size_for
from parallel_train.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer, needs_corpus
from parallel_train.errors import UserError

# (the text columns, the label column or None) of one layout of rows, as transformers' example scripts read them.
Layout = tuple[tuple[str, ...], str | None]
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")


@dataclass
class Rows:
    """The rows a task reads: each column's values, train rows then validation rows, and where each row came from."""

    texts: tuple[str, ...]  # the text columns read, in order
    label: str | None  # the label (or target) column read
    train: dict[str, list]  # column -> the train rows' values
    val: dict[str, list]
    features: dict[str, Any]  # column -> its `datasets` feature (a ClassLabel holds the class names)
    how: str  # how the validation rows were chosen, for the banner
    starts: list[int] = field(default_factory=list)  # the first row (train, then validation) of each file...
    files: list[str] = field(default_factory=list)  # ...and that file's label

    def where(self, split: str, i: int) -> str:
        """'FILE: row N' of row i of `split` (train or validation), for messages."""
        n = i + (len(next(iter(self.train.values()))) if split == "validation" else 0)
        at = bisect.bisect_right(self.starts, n) - 1
        return f"{self.files[at]}: row {n - self.starts[at] + 1}"


def save_to_disk_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def tables(path: str) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(train tables, validation tables) of data.path: (label, datasets.Dataset) each, rows in file order; no
    validation table unless the folder has a validation split (validation files, or a save_to_disk DatasetDict's)."""
    if not save_to_disk_folder(Path(path)):
        val_files = folder_splits(Path(path)).get("validation", []) if Path(path).is_dir() else []
        return row_datasets([path], "data.path"), row_datasets(val_files, "data.path") if val_files else []
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise loading_error(e, "data.path", path) from None
    if isinstance(loaded, datasets.Dataset):
        return [(path, loaded)], []
    if "train" not in loaded:
        raise UserError(f"data.path: {path!r} has no train split (splits: {', '.join(loaded)}); save the training rows as 'train'")
    val = [(f"{path} (validation)", loaded["validation"])] if "validation" in loaded else []
    return [(f"{path} (train)", loaded["train"])], val


def has_validation_split(path: str) -> bool:
    """Whether data.path holds validation rows of its own, by the rule `tables` (and an imagefolder) splits by: a
    save_to_disk DatasetDict with a validation split, or a folder's validation files (validation.jsonl, dev.csv, val/).
    config/usage.py asks it before anything is read: data.val_fraction is then not read."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    if save_to_disk_folder(folder):
        try:
            return "validation" in json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        except (OSError, ValueError, AttributeError):  # a Dataset (no dataset_dict.json), or a file the load refuses
            return False
    return "validation" in folder_splits(folder)


def first_columns(path: str) -> list[str] | None:
    """The columns of data.path's first train table, read from its first row only (a local file, a folder of them, a
    save_to_disk folder); None where they cannot be seen without reading more (a Hub name, a file the load refuses:
    the load then says why). config/usage.py asks it before the data is read."""
    try:
        import datasets

        datasets.disable_progress_bars()
        if save_to_disk_folder(Path(path)):
            loaded = datasets.load_from_disk(path)  # memory-mapped: nothing is read but the schema
            return (loaded if isinstance(loaded, datasets.Dataset) else loaded["train"]).column_names
        if not Path(path).exists():
            return None
        source = resolve_inputs([path], "data.path")[0]
        first = datasets.load_dataset(source.builder, data_files=source.files[:1], split="train", streaming=True)
        return list(next(iter(first)))
    except Exception:  # noqa: BLE001 (whatever it is, the load says it in one line)
        return None


def choose_columns(layouts: tuple[Layout, ...], d: Any, have: list[str], where: str, task: str) -> Layout:
    """The layout of the first table: data.text_columns and data.label_column where set, else the first of the
    task's layouts whose columns are all there. A column missing: one line naming the file and its columns."""
    given = tuple(d.text_columns)
    candidates = [(given or texts, d.label_column or label) for texts, label in layouts]
    for texts, label in candidates:
        if all(c in have for c in texts) and (label is None or label in have):
            return texts, label
    columns = ", ".join(have)
    texts, label = candidates[0]
    if given or d.label_column:
        for key, wanted in (("data.text_columns", texts if given else ()), ("data.label_column", (label,) if d.label_column else ())):
            if missing := [c for c in wanted if c not in have]:
                raise UserError(f"{key}: {missing[0]!r} is not a column of {where}; columns: {columns}")
    known = " / ".join(",".join((*t, *([lab] if lab else []))) for t, lab in layouts)
    raise UserError(
        f"data.path: {where} has the columns {columns}, none of model.task={task}'s layouts ({known}); "
        "name yours with data.text_columns=[...] and data.label_column=..."
    )


def read_rows(cfg: Any, layouts: tuple[Layout, ...], task: str) -> Rows:
    """The rows of data.path in the columns the task reads (`choose_columns`), split into train and validation."""
    d = cfg.data
    if d.format != "text" or d.streaming:
        what = f"data.format={d.format}" if d.format != "text" else "data.streaming=true"
        raise UserError(f"{what}: model.task={task} reads rows of its own columns, in memory; drop {what.split('=')[0]}")
    train_tables, val_tables = tables(d.path)
    texts, label = choose_columns(layouts, d, train_tables[0][1].column_names, train_tables[0][0], task)
    columns = [*texts, *([label] if label else [])]
    values: dict[str, list] = {c: [] for c in columns}
    starts, files = [], []
    for where, ds in train_tables + val_tables:
        if missing := [c for c in columns if c not in ds.column_names]:
            raise UserError(
                f"data.path: {where} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); give files of one layout"
            )
        starts.append(len(values[columns[0]]))
        files.append(where)
        for c, column in ds.select_columns(columns).to_dict().items():
            values[c] += column
    n = len(values[columns[0]])
    if val_tables:
        n_train, how = starts[len(train_tables)], "the validation split"
    else:
        n_train, how = n - max(1, int(n * d.val_fraction)), f"the last data.val_fraction={d.val_fraction} of the rows"
    if n_train < 1 or n_train == n:
        raise UserError(f"data.path: {d.path!r} holds {n} rows; a train and a validation row need at least 2")
    rows = Rows(
        tuple(texts), label, {c: v[:n_train] for c, v in values.items()}, {c: v[n_train:] for c, v in values.items()},
        {c: train_tables[0][1].features[c] for c in columns}, how, starts, files,
    )  # fmt: skip
    check_filled(rows)
    return rows


def check_filled(rows: Rows) -> None:
    """A row without a value in a column the task reads is one line naming it (the tokenizer would fail on it)."""
    for split, part in (("train", rows.train), ("validation", rows.val)):
        for column, values in part.items():
            if (i := next((i for i, v in enumerate(values) if v is None), None)) is not None:
                raise UserError(f"data.path: {rows.where(split, i)} has no {column!r}; fill it in or remove the row")


def column_texts(rows: Rows, part: dict[str, list], column: str, split: str) -> list[str]:
    """A text column's values as text (a number is its text); a dict or a list is one line naming the row."""
    values = part[column]
    if (i := not_text(values)) is not None:
        raise UserError(
            f"data.path: {rows.where(split, i)} holds a {type(values[i]).__name__} in {column!r}, not text; give text, or name "
            "the columns of text with data.text_columns"
        )
    return [str(t) for t in values]


def drop_blank(rows: Rows) -> Rows:
    """The rows whose text is more than whitespace (a .txt file's blank lines hold nothing to learn: run_mlm's
    line_by_line drops them too), after the train/validation split as run_mlm drops them; the banner says how many."""
    column = rows.texts[0]
    parts, dropped = {}, 0
    for split, part in (("train", rows.train), ("validation", rows.val)):
        kept = [i for i, v in enumerate(part[column]) if str(v).strip()]
        if not kept:
            raise UserError(f"data.path: every {split} row's {column!r} is blank (of {len(part[column])}); give rows with text")
        parts[split], dropped = {c: [v[i] for i in kept] for c, v in part.items()}, dropped + len(part[column]) - len(kept)
    how = rows.how + (f"; {dropped:,} blank row{'s' * (dropped > 1)} dropped" if dropped else "")
    return Rows(rows.texts, rows.label, parts["train"], parts["validation"], rows.features, how, rows.starts, rows.files)


def check_text_columns(d: Any, task: str, counts: tuple[int, ...]) -> None:
    """data.text_columns names as many columns as the task reads."""
    if d.text_columns and len(d.text_columns) not in counts:
        raise UserError(
            f"data.text_columns: model.task={task} reads {' or '.join(map(str, counts))} text column(s), not "
            f"{len(d.text_columns)} ({', '.join(d.text_columns)}); e.g. data.text_columns=[{','.join(['text'] * counts[0])}]"
        )


# ---------------------------------------------------------------- the tokenizer and encodings cut per batch


def task_tokenizer(cfg: Any, saved: Tokenizer | None, task: str) -> HFTokenizer:
    """The run's tokenizer: data.tokenizer (the model's folder by default), or the resumed run's, which must be
    what data.tokenizer names. A Hugging Face tokenizer (tokenizer.json), whose post-processor adds the model's
    special tokens ([CLS] a [SEP] b [SEP]) and whose encodings know each token's word."""
    spec = cfg.data.tokenizer
    if saved is None and needs_corpus(spec):
        raise UserError(
            f"model.task={task}: data.tokenizer={spec} is built from a corpus; give the model's tokenizer (its folder, a "
            "tokenizer.json, or a Hub tokenizer name)"
        )
    tokenizer = load_tokenizer(spec) if saved is None else saved
    if saved is not None:
        check_resumed_tokenizer(saved, spec)
    if not isinstance(tokenizer, HFTokenizer):
        raise UserError(
            f"model.task={task}: data.tokenizer={spec} has no special tokens; give the model's tokenizer (a tokenizer.json or its folder)"
        )
    return tokenizer


def tokenizer_files(spec: str) -> dict[str, str]:
    """The tokenizer folder's tokenizer_config.json (its special tokens: what AutoTokenizer reloads), to save beside
    the run's tokenizer.json; nothing for a tokenizer.json alone."""
    config = Path(spec).expanduser() / "tokenizer_config.json"
    return {config.name: config.read_text(encoding="utf-8")} if config.is_file() else {}


def special_id(core: Any, names: tuple[str, ...]) -> int | None:
    """The id of the first of `names` the tokenizer has."""
    return next((i for i in map(core.token_to_id, names) if i is not None), None)


@dataclass
class Encoder:
    """Texts -> encodings of exactly block_size tokens: the run's tokenizer with its post-processor, truncated
    (longest_first for pairs, as transformers does) and padded. A copy: the run's tokenizer.json stays as it was."""

    core: Any
    block_size: int
    pad_id: int
    type_ids: bool  # the post-processor tells the two texts of a pair apart: batches carry token_type_ids

    @classmethod
    def of(cls, tokenizer: HFTokenizer, block_size: int) -> Encoder:
        from tokenizers import Tokenizer as Core

        core = Core.from_str(tokenizer.tokenizer.to_str())
        pad_id = core.padding["pad_id"] if core.padding else special_id(core, PAD_TOKENS)
        pad_id = pad_id if pad_id is not None else tokenizer.eot if tokenizer.eot is not None else 0
        core.no_padding()
        core.no_truncation()
        type_ids = core.post_processor is not None and any(core.encode("a", "b").type_ids)
        core.enable_truncation(block_size)
        core.enable_padding(length=block_size, pad_id=pad_id, pad_token=core.id_to_token(pad_id) or "")
        return cls(core, block_size, pad_id, type_ids)

    def encode(self, inputs: list, pretokenized: bool = False) -> list[Any]:
        """Encodings of `inputs`: texts, (text, text) pairs, or lists of words (`pretokenized`)."""
        try:
            encodings = self.core.encode_batch(inputs, is_pretokenized=pretokenized)
        except Exception as e:  # tokenizers raises bare Exceptions
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise UserError(f"model.block_size={self.block_size}: the tokenizer cannot encode the rows at this length ({first})") from None
        # What cannot be cut (the special tokens of a block too short for them) comes back longer, without a word.
        if longer := next((e for e in encodings if len(e.ids) != self.block_size), None):
            raise UserError(
                f"model.block_size={self.block_size}: the tokenizer cannot encode the rows at this length (a row takes "
                f"{len(longer.ids)} tokens with its special tokens, which are never cut); raise model.block_size"
            )
        return encodings

    def arrays(self, encodings: list[Any], pairs: bool = False) -> dict[str, np.ndarray]:
        """input_ids, attention_mask (1: a token, 0: padding) and, for pairs when the tokenizer tells their texts
        apart, token_type_ids (a single text's are all 0, every model's default: not every model takes the key)."""
        out = {
            "input_ids": np.asarray([e.ids for e in encodings], dtype=np.int32),
            "attention_mask": np.asarray([e.attention_mask for e in encodings], dtype=np.int32),
        }
        if pairs and self.type_ids:
            out["token_type_ids"] = np.asarray([e.type_ids for e in encodings], dtype=np.int32)
        return out


class EncodedRows(Dataset):
    """Rows encoded once: sample i is {key: arrays[key][i]}; a batch is a dict of (B, ...) int64 tensors (torch's
    index type), kept as int32 in between: half the memory.

    Encoded at model.block_size, each batch is cut to its longest row, rounded up to a multiple of 8 (as the scripts'
    collators pad with pad_to_multiple_of=8): what is cut is padding alone, whose labels are -100 and which the
    attention mask hides, so the loss is the same, in a fraction of the time. Unless `fixed` (task_data: the layouts
    that need one shape). A row's length is its attention mask's sum; `lengths` gives other keys their own (a
    seq2seq's targets)."""

    fixed = True  # task_data sets it from the layout (fixed_shapes)

    def __init__(self, arrays: dict[str, np.ndarray], lengths: dict[str, np.ndarray] | None = None):
        self.arrays = arrays
        self.real = arrays["attention_mask"].sum(axis=1)  # tokens per row
        self.lengths = lengths or {}

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The rows at model.block_size."""
        return {k: torch.from_numpy(v[indices].astype(np.int64)) for k, v in self.arrays.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.cut(self.rows(indices), indices)

    def cut(self, batch: dict[str, torch.Tensor], indices: Any) -> dict[str, torch.Tensor]:
        """Each (B, T) tensor to the longest of the rows at `indices`, rounded up to ALIGN (at most T)."""
        if self.fixed:
            return batch
        out = {}
        for key, value in batch.items():
            if value.dim() == 2:
                longest = int(self.lengths.get(key, self.real)[indices].max())
                value = value[:, : min(value.shape[1], -(-longest // ALIGN) * ALIGN)].contiguous()
            out[key] = value
        return out

    def widest(self) -> dict[str, torch.Tensor]:
        """One sample at the widest shape a batch takes (the memory estimate's worst case: data/batch.py)."""
        return {k: v[0] for k, v in self.cut(self.rows([0]), slice(None)).items()}


def fixed_shapes(cfg: Any) -> str | None:
    """Why every batch must be model.block_size long on this layout (None: it need not): torch's pipeline schedules
    and torch.compile want one shape, and tensor parallelism keeps to the lengths it divides."""
    p = cfg.parallel
    why = [
        w
        for w, on in (("pipeline stages", p.pipeline_stages > 1), ("tensor parallel", p.tp > 1), ("torch.compile", cfg.train.compile))
        if on
    ]
    return " and ".join(why) or None


def task_data(cfg: Any, tokenizer: HFTokenizer, rows: Rows, train: Dataset, val: Dataset, **fields: Any) -> Data:
    """The Data of a text task: its datasets serve dict batches; the tokenizer folder's config travels with the run
    (beside tokenizer.json, and whatever `fields` add to Data.files: the class names)."""
    files = {**tokenizer_files(cfg.data.tokenizer), **fields.pop("files", {})}
    train.fixed = val.fixed = fixed_shapes(cfg) is not None
    keys = list(train.__getitems__([0]))
    return Data(
        train, val, tokenizer, vocab_size_for(tokenizer, cfg), description=describe(cfg, rows, keys), files=files, **fields
    )  # fmt: skip


def describe(cfg: Any, rows: Rows, keys: list[str]) -> str:
    """The banner's data line."""
    n_train, n_val = len(rows.train[rows.texts[0]]), len(rows.val[rows.texts[0]])
    read = ", ".join((*rows.texts, *([rows.label] if rows.label else [])))
    why = fixed_shapes(cfg)
    padded = f"padded to model.block_size={cfg.model.block_size} ({why}: one shape)" if why else (
        f"padded to each batch's longest (a multiple of {ALIGN}, at most model.block_size={cfg.model.block_size})")  # fmt: skip
    return f"{cfg.data.path}: {n_train:,} train + {n_val:,} val rows ({rows.how}); columns {read} -> {', '.join(keys)}, {padded}"
