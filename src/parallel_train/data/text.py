"""Data: read a corpus with Hugging Face `datasets`, tokenize it, cut it into windows, and build the loaders.

`build_datasets` is the built-in `text` data source for a corpus that fits in memory (data/sources.py names the
others; data/prepared.py and data/streaming.py read data that does not). The train loader reads this rank's
share of every global batch through data/batch_sampler.py, which is what makes every topology train on the same
samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from parallel_train.config.sections import Config, DataConfig
from parallel_train.data.batch import with_labels
from parallel_train.data.batch_sampler import GlobalBatchSampler
from parallel_train.data.inputs import LOCAL_FORMATS, describe_folder, load_source, loading_error, not_text, resolve_inputs
from parallel_train.data.permutation import SeededPermutation
from parallel_train.data.tokenizers import ByteVocab, Tokenizer, load_tokenizer, needs_corpus
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX

# ---------------------------------------------------------------- corpus


def load_corpus(cfg: DataConfig) -> str:
    """Read the whole corpus as one string through `datasets` (local file, folder or Hub dataset)."""
    return read_corpus(cfg)[0]


def read_corpus(cfg: DataConfig) -> tuple[str, str | None]:
    """(the whole corpus as one string, what a folder held: read and skipped, for the start banner)."""
    import datasets  # lazy: costs about 1.7 s, and the random/synthetic data need none of it

    datasets.disable_progress_bars()
    path, read = Path(cfg.path), None
    try:
        if path.is_dir():  # every data file, by the rule of scripts/prepare_data.py (data/inputs.py)
            text, read = read_folder(cfg)
        elif path.suffix.lower() in LOCAL_FORMATS or path.exists():
            if not path.is_file():
                raise UserError(f"data.path: no such file {cfg.path!r} (give a .txt/.json/.jsonl/.csv/.parquet file)")
            fmt = LOCAL_FORMATS.get(path.suffix.lower(), "text")
            if fmt == "text":
                ds = datasets.load_dataset("text", data_files=str(path), split="train", sample_by="document")
            else:
                ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
            text = joined_column(ds, cfg)
        else:
            text = joined_column(datasets.load_dataset(cfg.path, split="train"), cfg)
    except UserError:
        raise
    except Exception as e:
        raise loading_error(e, "data.path", cfg.path, [cfg.path] if path.is_file() else []) from None
    if "\x00" in text:
        raise UserError(f"data.path: {cfg.path!r} contains NUL bytes; is it a binary file?")
    return text, read


def joined_column(ds, cfg: DataConfig) -> str:
    """data.text_column's rows joined by newlines."""
    if cfg.text_column not in ds.column_names:
        raise UserError(f"data.text_column: {cfg.text_column!r} is not a column of {cfg.path!r}; columns: {', '.join(ds.column_names)}")
    return "\n".join(texts(ds[cfg.text_column], cfg, cfg.path))


def texts(values: list, cfg: DataConfig, where: str) -> list[str]:
    """A column's rows as text, the rows without any (null) left out; a dict or a list is one line naming the row."""
    if (i := not_text(values)) is not None:
        raise UserError(
            f"data.text_column: row {i + 1} of {where!r} holds a {type(values[i]).__name__} in {cfg.text_column!r}, not text; "
            "name a column of text with data.text_column"
        )
    return [str(t) for t in values if t is not None]


def read_folder(cfg: DataConfig) -> tuple[str, str]:
    """A folder's data files as one text: text files as one stream, rows of the others as documents joined by
    newlines. A file of another kind is a one-line error; what is left out (the dataset card README.md, other
    splits) is named in the returned description."""
    sources = resolve_inputs([cfg.path], key="data.path")
    parts = []
    for src in sources:
        rows = texts(load_source(src, cfg.text_column, None, column_key="data.text_column")["text"], cfg, src.label)
        parts.append("\n".join(rows) if src.documents else "".join(rows))
    return "\n".join(parts), describe_folder(Path(cfg.path), sources)


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


class PaddedWindows(TokenWindows):
    """TokenWindows whose samples end early: sample i keeps its first 1 + (i * 7919) % block_size targets and the
    rest are IGNORE_INDEX, as in a batch of padded answers of different lengths (data.synthetic_padding)."""

    def _mask(self, indices: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keep = 1 + (indices * 7919) % self.block_size
        return y.masked_fill(torch.arange(self.block_size) >= keep.unsqueeze(-1), IGNORE_INDEX)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return x, self._mask(torch.tensor(i), y)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitems__(indices)
        return x, self._mask(torch.as_tensor(indices), y)


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


# ---------------------------------------------------------------- assembly


@dataclass
class Data:
    train_set: Dataset | None  # None for a stream (train_stream below)
    val_set: Dataset
    vocab: Tokenizer | None  # the tokenizer (data/tokenizers.py); None for data without one (random, synthetic)
    vocab_size: int
    # Turns a list of samples into the (inputs, targets) batch the engine expects. None: the datasets
    # above batch themselves (__getitems__); any other dataset gets torch's default_collate.
    collate: Callable[[list], tuple[torch.Tensor, torch.Tensor]] | None = None
    # How samples are shuffled (data/batch_sampler.py): "randperm" (a stored permutation) or "seeded" (computed:
    # O(1) memory, for data of any size).
    order: str = "randperm"
    description: str | None = None  # one line for the start banner
    # Streamed data (data/streaming.py): (world, rank, saved position or None) -> this rank's batches, an
    # iterator with state_dict(); the trainer saves that position in every checkpoint.
    train_stream: Callable[[int, int, Any], Iterator] | None = None
    # No target is IGNORE_INDEX (losses.py): windows of text, class labels. The optimizer step then knows its
    # count of valid targets without asking the other ranks (step.py); False (the safe default for a source you
    # add) counts them, one all-reduce of one number per step.
    all_targets_count: bool = False
    # What a batch's inputs are, checked against the model's `inputs` (core/model_config.py): "token ids" or "feature vectors".
    inputs: str = "token ids"
    # Files the run saves beside its tokenizer, in output_dir and every checkpoint (name -> text): a chat template
    # and the tokenizer's config (data/chat_format.py), so that scripts/sample.py --chat renders as training did.
    files: dict[str, str] = field(default_factory=dict)
    # The class names of a task with labels (tasks/: sequence, token and image classification): label id i is
    # label_names[i]. Taken from the data, the same on every rank and across a resume; the export's id2label.
    label_names: list[str] | None = None
    # The train set takes stream positions, epoch * len(train_set) + index, instead of indices (data/batch_sampler.py):
    # a sample may be drawn differently in each epoch, the same on every topology and after a resume (masked-LM masks).
    with_epoch: bool = False


def collate_fn(data: Data, dataset: Dataset) -> Callable:
    """The Data's collate, else the dataset's own batches (__getitems__), else torch's default_collate; a dict batch's
    "label" named "labels" (data/batch.py's with_labels)."""
    collate = data.collate or (keep_batch if hasattr(dataset, "__getitems__") else default_collate)
    return partial(labelled, collate)


def labelled(collate: Callable, samples: list) -> Any:
    """collate(samples) with a dict's "label" named "labels" (a module function: a loader worker pickles it)."""
    return with_labels(collate(samples))


def vocab_size_for(tokenizer: Tokenizer, cfg: Config) -> int:
    """The model's vocabulary: the tokenizer's, padded up to model.vocab_size; a smaller model.vocab_size is an error."""
    m = cfg.model
    if m.vocab_size and tokenizer.size > m.vocab_size:
        raise UserError(
            f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {tokenizer.size:,} ids; "
            f"set model.vocab_size=0 (the tokenizer's size) or at least {tokenizer.size}"
        )
    return max(tokenizer.size, m.vocab_size)


def corpus_tokenizer(spec: str, text: str, saved: Tokenizer | None) -> Tokenizer:
    """The tokenizer for an in-memory corpus: the resumed run's (its ids must not shift), else built from the text."""
    if saved is None:
        return load_tokenizer(spec, corpus=lambda: [[text]])
    check_resumed_tokenizer(saved, spec)
    return saved


def check_resumed_tokenizer(saved: Tokenizer, spec: str) -> None:
    """The resumed run's tokenizer is what data.tokenizer names (of that kind, for the ones built from the corpus)."""
    if needs_corpus(spec) or spec == "byte":  # char, byte, word, bpe:N: the saved one must be of that kind
        kind = {"char": "char", "byte": "byte"}.get(spec, "hf")
        if saved.kind != kind:
            used = saved.kind if saved.kind != "hf" else "the bpe:N, word or tokenizer.json it was started with"
            raise UserError(f"data.tokenizer: the resumed run used the {saved.kind} tokenizer; resume with data.tokenizer={used}")
    elif saved.fingerprint != load_tokenizer(spec).fingerprint:
        raise UserError(f"data.tokenizer: the resumed run used another tokenizer than {spec!r}; resume with the one it was started with")


def build_datasets(cfg: Config, vocab: Tokenizer | None = None) -> Data:
    """The `text` data source: load, tokenize and split data.path. Pass the saved vocab when resuming so ids stay the same."""
    d, m = cfg.data, cfg.model
    if d.path == "random":
        return random_classification(cfg)

    if d.path == "synthetic":
        return synthetic_data(cfg)

    text, read = read_corpus(d)
    if not text:
        raise UserError(f"data.path: {d.path!r} is empty")
    vocab = corpus_tokenizer(d.tokenizer, text, vocab)
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
    windows = TokenWindows(train_ids, m.block_size), TokenWindows(val_ids, m.block_size)
    return Data(*windows, vocab, vocab_size_for(vocab, cfg), description=read, all_targets_count=True)


def random_classification(cfg: Config) -> Data:
    """Random inputs and class labels (data.path=random), shaped for the seed MLP: model.in_features inputs,
    model.out_features classes."""
    d, m = cfg.data, cfg.model
    in_features, classes = getattr(m, "in_features", None), getattr(m, "out_features", None)  # the MLP's own keys
    if in_features is None or classes is None:
        raise UserError(
            f"data.path=random makes (features, class) samples for model.name=mlp, not for model.name={m.name}; use a text corpus"
        )
    train = RandomClassification(d.num_samples, in_features, classes, seed=cfg.train.seed)
    val = RandomClassification(d.num_samples, in_features, classes, seed=cfg.train.seed + 1)
    return Data(train, val, None, classes, inputs="feature vectors", all_targets_count=True)


def synthetic_data(cfg: Config) -> Data:
    """Uniformly random token ids (data.path=synthetic): speed benchmarks with no download and no tokenizer.

    The loss stays near ln(vocab_size): there is nothing to learn. The vocabulary is model.vocab_size
    (or 256, the byte vocabulary); the train split holds data.num_samples tokens (at least two windows). With
    data.synthetic_padding each sample's targets end early (PaddedWindows): batches of uneven valid tokens.
    """
    d, m = cfg.data, cfg.model
    vocab_size = m.vocab_size or ByteVocab.size
    g = torch.Generator().manual_seed(cfg.train.seed)
    n_train = max(d.num_samples, m.block_size + 2)
    n_val = max(int(n_train * d.val_fraction), m.block_size + 2)
    ids = torch.randint(0, vocab_size, (n_train + n_val,), generator=g)
    windows = PaddedWindows if d.synthetic_padding else TokenWindows
    train, val = windows(ids[:n_train], m.block_size), windows(ids[n_train:], m.block_size)
    return Data(train, val, None, vocab_size, all_targets_count=not d.synthetic_padding)


def train_loader(
    data: Data, cfg: Config, world_size: int, rank: int, start_step: int, pin_memory: bool, stream_state: Any = None
) -> DataLoader | Iterator:
    """This rank's batches from optimizer step `start_step` on (never ends; the loop counts steps). A stream
    continues from `stream_state`, the position its checkpoint saved."""
    if data.train_stream is not None:
        return data.train_stream(world_size, rank, stream_state)
    sampler = GlobalBatchSampler(
        len(data.train_set),
        cfg.train.batch_size,
        world_size,
        rank,
        cfg.train.seed,
        start_micro_step=start_step * cfg.train.gradient_accumulation_steps,
        order=data.order,
        with_epoch=data.with_epoch,
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


def eval_batch_size(cfg: Config, dp_size: int) -> int:
    """Samples per validation batch, across all data-parallel ranks: eval.batch_size, else the samples of one
    micro-step of the global batch (train.batch_size x data-parallel ranks), which is the same number on every
    layout of one global batch: 1 x 8 and 2 x 4 evaluate the same samples."""
    return cfg.eval.batch_size or cfg.train.batch_size * dp_size


def val_loader(data: Data, cfg: Config, dp_size: int) -> DataLoader:
    """A fixed set of eval.iters global batches of validation samples, the same at every evaluation; each
    global batch is split across the data-parallel ranks by evaluation.py, so every sample counts exactly once."""
    batch_size = eval_batch_size(cfg, dp_size)
    if not cfg.eval.iters:  # the whole split in its order, each sample once (a task's validation set, scored whole)
        return DataLoader(data.val_set, batch_size=batch_size, shuffle=False, collate_fn=collate_fn(data, data.val_set))
    n_eval = cfg.eval.iters * batch_size
    g = torch.Generator().manual_seed(cfg.train.seed + 7919)
    n = len(data.val_set)
    if data.order == "seeded":  # no stored permutation: data of any size
        indices = SeededPermutation(n, cfg.train.seed + 7919).take(0, 0, min(n, n_eval)).tolist()
        indices = (indices * (n_eval // len(indices) + 1))[:n_eval]  # a short split repeats its windows
    else:
        indices = (torch.randperm(n, generator=g)[:n_eval] if n >= n_eval else torch.randint(0, n, (n_eval,), generator=g)).tolist()
    subset = torch.utils.data.Subset(data.val_set, indices)
    return DataLoader(
        subset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_fn(data, data.val_set),
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
