"""Prepare data once: read the inputs through `datasets`, tokenize them in parallel, write token shards.

The pattern is nanoGPT's (data/prepare.py for OpenWebText): `datasets.map(batched=True, num_proc=N)` tokenizes into
Arrow files on disk, and the ids are then written out as flat uint16 (or uint32) files that training reads
through memory maps. What this adds: every input kind (files, globs, a Hub-style folder, a Hub name), every
tokenizer kind (data/tokenizers.py), shards with a sha256 each, a metadata file (data/prepared.py's format)
written last, an inputs fingerprint that makes a second run with the same inputs a no-op, and files that
are written whole and then renamed, so that a kill at any moment leaves nothing training takes for complete.

Text files are read line by line (line breaks kept), so the text is tokenized as one stream; rows of
json/jsonl/csv/parquet files and Hub datasets are documents, each followed by the tokenizer's end-of-text
token (or a newline, for char and byte).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train import faults
from parallel_train.core.json_text import json_text
from parallel_train.data.inputs import Source, load_source, resolve_inputs
from parallel_train.data.prepared import CHAT_FILES, FORMAT, META, SPLITS, VERSION, read_meta, shard_name, shard_problem, token_dtype
from parallel_train.data.tokenizers import HF_FILE, VOCAB_FILE, Tokenizer, load_tokenizer, needs_corpus
from parallel_train.errors import UserError

WORK = ".prepare-work"  # scratch space inside the output folder (datasets' Arrow files), removed at the end
BATCH_ROWS = 1000  # rows per map batch: about 40 KB of text for a text file's lines


@dataclass
class Options:
    inputs: list[str]
    output: Path
    tokenizer: str
    text_column: str = "text"
    val_fraction: float = 0.1
    num_proc: int = 1
    shard_tokens: int = 100_000_000
    overwrite: bool = False
    # --format chat|instruction: rows of samples with the mask of what they learn (data/prepare_samples.py)
    format: str = "text"
    chat_template: str = ""
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"


# ---------------------------------------------------------------- tokenizing


def text_batches(datasets_: list, rows: int = BATCH_ROWS):
    """Every source's texts in batches of `rows` (strings; missing values left out)."""
    for ds in datasets_:
        for batch in ds.iter(batch_size=rows):
            yield [str(t) for t in batch["text"] if t is not None]


def build_tokenizer(spec: str, texts: list, num_proc: int) -> Tokenizer:
    """A tokenizer that needs the corpus (char, word, bpe:N) is built from `texts`; the others are loaded."""
    if not needs_corpus(spec):
        return load_tokenizer(spec)
    if spec != "char":  # trained by `tokenizers` from batches of texts
        return load_tokenizer(spec, corpus=lambda: text_batches(texts))
    sets = [ds.map(_chars_of, batched=True, batch_size=BATCH_ROWS, num_proc=_procs(ds, num_proc), remove_columns=["text"], desc="characters")
            for ds in texts]  # fmt: skip
    chars = set().union(*("".join(c) for s in sets for c in s["chars"]))
    return load_tokenizer(spec, corpus=lambda: [[("".join(sorted(chars)))]])


def _chars_of(batch: dict[str, list]) -> dict[str, list]:
    return {"chars": ["".join(set("".join(t for t in batch["text"] if t is not None)))]}


def _procs(ds, num_proc: int) -> int | None:
    return min(num_proc, max(1, len(ds) // BATCH_ROWS)) if num_proc > 1 else None


class Encoder:
    """The map function: a batch of rows -> one row of token ids (and the number of characters they hold)."""

    def __init__(self, tokenizer: Tokenizer, documents: bool, dtype: str, label: str = "the input"):
        self.tokenizer, self.documents, self.dtype, self.label = tokenizer, documents, dtype, label

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [str(t) for t in batch["text"] if t is not None]
        if any("\x00" in t for t in texts):
            raise UserError(f"--input {self.label}: contains NUL bytes; is it a binary file?")
        tok, eot = self.tokenizer, self.tokenizer.eot
        if self.documents and eot is None:  # char, byte: a newline ends every document
            texts = [t if t.endswith("\n") else t + "\n" for t in texts]
        if tok.kind == "hf":
            pieces = tok.encode_batch(texts)
            if self.documents and eot is not None:
                pieces = [p + [eot] for p in pieces]
            ids = np.fromiter((i for p in pieces for i in p), dtype=self.dtype)
        else:
            ids = tok.encode("".join(texts)).astype(self.dtype)
        return {"ids": [ids], "chars": [sum(map(len, texts))], "top": [int(ids.max()) if len(ids) else -1]}


def tokenize(sources: list[Source], texts: list, tokenizer: Tokenizer, dtype: str, num_proc: int, work: Path) -> list:
    from datasets import Features, Sequence, Value

    features = Features({"ids": Sequence(Value(dtype)), "chars": Value("int64"), "top": Value("int64")})
    if num_proc > 1:  # forked workers must not inherit tokenizers' threads (they would warn, then run serially)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return [
        ds.map(
            Encoder(tokenizer, src.documents, dtype, src.label),
            batched=True,
            batch_size=BATCH_ROWS,
            num_proc=_procs(ds, num_proc),
            remove_columns=["text"],
            features=features,
            cache_file_name=str(work / f"tokens_{i}.arrow"),
            desc=f"tokenizing {src.label}",
        )
        for i, (src, ds) in enumerate(zip(sources, texts, strict=True))
    ]


# ---------------------------------------------------------------- writing


class ShardWriter:
    """Writes one split as shards of at most `shard_tokens` tokens: each into NAME.tmp, flushed, then renamed."""

    written = 0  # shards written by this process, for fault injection

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int):
        self.folder, self.split, self.dtype, self.limit = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file, self._hash, self._count, self._top = None, None, 0, -1

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._file is None:
                name = shard_name(self.split, len(self.shards))
                self._file, self._hash, self._count, self._top = open(self.folder / f"{name}.tmp", "wb"), hashlib.sha256(), 0, -1
                self.shards.append({"file": name})
            piece = ids[: self.limit - self._count].astype(self.dtype.newbyteorder("<"), copy=False)
            data = piece.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(piece)
            self._top = max(self._top, int(piece.max()))  # what training checks against the tokenizer's vocabulary
            ids = ids[len(piece) :]
            if self._count == self.limit:
                self._close()

    def _close(self) -> None:
        f, name = self._file, self.shards[-1]["file"]
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(self.folder / f"{name}.tmp", self.folder / name)
        self.shards[-1].update(tokens=self._count, bytes=self._count * self.dtype.itemsize, sha256=self._hash.hexdigest(), max_id=self._top)
        self._file = None
        ShardWriter.written += 1
        faults.in_prepare(ShardWriter.written)  # test-only: a kill here must leave no dataset that looks complete

    def finish(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._close()
        return self.shards


def count_tokens(tokenized: list) -> int:
    import pyarrow.compute as pc

    return sum(int(pc.sum(pc.list_value_length(ds.data.column("ids"))).as_py() or 0) for ds in tokenized)


def check_ids(tokenized: list, tokenizer: Tokenizer, spec: str) -> None:
    """Every id is below the tokenizer's vocabulary size (which sizes the model's embedding), checked before anything
    in the output folder is replaced: an id beyond it would be an IndexError inside the embedding, mid-training."""
    import pyarrow.compute as pc

    tops = [pc.max(ds.data.column("top")).as_py() for ds in tokenized]
    top = max((t for t in tops if t is not None), default=-1)
    if top >= tokenizer.size:
        raise UserError(f"--tokenizer {spec}: gives token id {top:,}, beyond its {tokenizer.size:,} ids; is its tokenizer.json complete?")


def write_shards(tokenized: list, folder: Path, dtype: str, opts: Options, progress) -> dict[str, Any]:
    """Stream the tokenized rows into train shards, then (the last val_fraction of the tokens) val shards."""
    total = count_tokens(tokenized)
    val_start = total - int(total * opts.val_fraction)
    writers = {s: ShardWriter(folder, s, dtype, opts.shard_tokens) for s in SPLITS}
    chars = {s: 0.0 for s in SPLITS}
    pos = 0
    for ds in tokenized:
        for table in ds.with_format("arrow").iter(batch_size=4):  # a row holds the ids of up to 1 MB of text
            for ids, n_chars in zip(_rows(table), table.column("chars").to_pylist(), strict=True):
                cut = min(max(val_start - pos, 0), len(ids))
                writers["train"].write(ids[:cut])
                writers["val"].write(ids[cut:])
                if len(ids):  # characters split in proportion at the row that holds the boundary
                    chars["train"] += n_chars * cut / len(ids)
                    chars["val"] += n_chars * (len(ids) - cut) / len(ids)
                pos += len(ids)
                progress.update(len(ids))
    return {s: {"tokens": sum(x["tokens"] for x in w.finish()), "chars": round(chars[s]), "shards": w.shards} for s, w in writers.items()}


def _rows(table) -> list[np.ndarray]:
    """The token ids of every row of an Arrow batch, as numpy views (no Python lists)."""
    col = table.column("ids").combine_chunks()
    flat, offsets = col.flatten().to_numpy(zero_copy_only=False), col.offsets.to_numpy()
    return [flat[offsets[i] - offsets[0] : offsets[i + 1] - offsets[0]] for i in range(len(col))]


# ---------------------------------------------------------------- the whole preparation


def fingerprint(sources: list[Source], opts: Options) -> str:
    """The inputs (paths, sizes, modification times) and every option that changes the tokens."""
    tokenizer = opts.tokenizer if needs_corpus(opts.tokenizer) or opts.tokenizer == "byte" else load_tokenizer(opts.tokenizer).fingerprint
    described = {
        "version": VERSION,
        "inputs": [[s.builder, s.documents, s.stamp()] for s in sources],
        "tokenizer": tokenizer,
        "text_column": opts.text_column,
        "val_fraction": opts.val_fraction,
        "shard_tokens": opts.shard_tokens,
    }
    if opts.format != "text":  # rows of samples: which columns, and the template that renders them
        template = Path(opts.chat_template).read_bytes() if opts.chat_template and Path(opts.chat_template).is_file() else b""
        columns = [opts.messages_column] if opts.format == "chat" else [opts.prompt_column, opts.completion_column]
        described.update(format=opts.format, columns=columns, chat_template=hashlib.sha256(template).hexdigest())
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


OURS = ("train_*.bin", "val_*.bin", "*.tmp", ".*.tmp", META, WORK)  # and the tokenizer files, next to these


def up_to_date(out: Path, print_fn, inputs_fingerprint: str, overwrite: bool) -> bool:
    """True if `out` already holds these inputs, prepared alike. Refuses to replace anything else without --overwrite."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise UserError(f"--output {out}: is a file; give a folder")
    if (out / META).is_file():
        try:
            meta, _ = read_meta(out)
        except UserError:
            meta = None
        if meta is not None and meta["inputs"]["fingerprint"] == inputs_fingerprint and shard_problem(out, meta, full_hash=False) is None:
            n = sum(meta["splits"][s]["tokens"] for s in SPLITS)
            print_fn(
                f"up to date: {out} already holds these inputs prepared with {meta['tokenizer']['spec']} ({n:,} tokens); nothing to do"
            )
            return True
        if not overwrite:
            raise UserError(
                f"--output {out}: holds data prepared from other inputs or options; choose another --output or pass --overwrite"
            )
    ours = OURS + ((VOCAB_FILE, HF_FILE, *CHAT_FILES) if any(out.glob("train_*.bin")) else ())  # a lone tokenizer.json is not ours
    others = sorted(p.name for p in out.iterdir() if not any(p.match(g) for g in ours))
    if others:
        raise UserError(f"--output {out}: is not empty and holds no prepared data ({', '.join(others[:3])}); choose an empty or new folder")
    return False


def clear(out: Path) -> None:
    """Invalidate first (the metadata goes), then remove what an earlier or interrupted preparation left (not the
    scratch space of this one)."""
    (out / META).unlink(missing_ok=True)
    for pattern in (*OURS, VOCAB_FILE, HF_FILE, *CHAT_FILES):
        for p in out.glob(pattern):
            if p.name != WORK:
                shutil.rmtree(p) if p.is_dir() else p.unlink()


def prepare(opts: Options, print_fn=print) -> dict[str, Any] | None:
    """Prepare `opts.inputs` into `opts.output`; returns the metadata (None when already up to date).

    Everything that can fail on bad input (reading, the text column, the tokenizer, tokenizing) happens in a
    scratch folder before anything in `opts.output` is removed or replaced."""
    import datasets  # noqa: F401  (imported here so that the time reported leaves the import out: about 2 s)

    t0 = time.perf_counter()
    sources = resolve_inputs(opts.inputs)
    inputs_fingerprint = fingerprint(sources, opts)
    out = opts.output
    if up_to_date(out, print_fn, inputs_fingerprint, opts.overwrite):
        return None
    created = not out.exists()
    work = out / WORK
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir(parents=True)
    except OSError as e:  # a path under a file, a read-only or full disk: before anything is read
        raise UserError(f"--output {out}: cannot be written ({e.strerror}); give a folder you can write") from None
    try:
        meta = _prepare_into(out, work, sources, inputs_fingerprint, opts)
    except BaseException:  # a bad input found late: what the folder held stays, the scratch space goes
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    shutil.rmtree(work, ignore_errors=True)
    seconds, splits = time.perf_counter() - t0, meta["splits"]
    meta["prepare_seconds"] = round(seconds, 2)
    _write_meta(out, meta)  # last: only now is the folder a dataset
    mb = meta["inputs"]["bytes"] / 1e6
    print_fn(
        f"prepared {out}: {splits['train']['tokens'] + splits['val']['tokens']:,} tokens (train {splits['train']['tokens']:,}, "
        f"val {splits['val']['tokens']:,}) in {sum(len(splits[s]['shards']) for s in SPLITS)} shards, tokenizer {opts.tokenizer} "
        f"({meta['tokenizer']['vocab_size']:,} ids, {meta['dtype']}); {mb:,.1f} MB of text in {seconds:.1f} s ({mb / seconds:,.1f} MB/s)"
    )
    return meta


def _prepare_into(out: Path, work: Path, sources: list[Source], inputs_fingerprint: str, opts: Options) -> dict[str, Any]:
    import datasets
    from tqdm.auto import tqdm

    if opts.format != "text":
        return _prepare_samples_into(out, sources, inputs_fingerprint, opts)

    texts = [load_source(src, opts.text_column, work / "hf") for src in sources]
    if not any(len(ds) for ds in texts):
        raise UserError(f"--input {' '.join(opts.inputs)}: no text (empty)")
    tokenizer = build_tokenizer(opts.tokenizer, texts, opts.num_proc)
    dtype = token_dtype(tokenizer.size)
    tokenized = tokenize(sources, texts, tokenizer, dtype, opts.num_proc, work)
    if count_tokens(tokenized) == 0:
        raise UserError(f"--input {' '.join(opts.inputs)}: no text (empty)")
    check_ids(tokenized, tokenizer, opts.tokenizer)
    clear(out)  # from here on the folder is not a dataset until the metadata is written
    with tqdm(desc="writing shards", unit="tok", unit_scale=True, disable=None) as progress:
        splits = write_shards(tokenized, out, dtype, opts, progress)
    tokenizer.save(out)
    local = all(s.files for s in sources)  # a Hub dataset has no files here: count its characters
    text_bytes = sum(os.path.getsize(f) for s in sources for f in s.files) if local else sum(splits[s]["chars"] for s in SPLITS)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"spec": opts.tokenizer, "kind": tokenizer.kind, "vocab_size": tokenizer.size, "eot": tokenizer.eot,
                      "fingerprint": tokenizer.fingerprint, "files": sorted(tokenizer.files())},
        "dtype": dtype,
        "splits": splits,
        "val_fraction": opts.val_fraction,
        "inputs": {"fingerprint": inputs_fingerprint, "given": opts.inputs, "text_column": opts.text_column, "bytes": text_bytes},
        "datasets_version": datasets.__version__,
    }  # fmt: skip


def _prepare_samples_into(out: Path, sources: list[Source], inputs_fingerprint: str, opts: Options) -> dict[str, Any]:
    """--format chat|instruction (data/prepare_samples.py): everything that can fail on bad rows runs before `clear`."""
    from parallel_train.data import prepare_samples

    rendered = prepare_samples.render(opts)
    clear(out)
    prepared = prepare_samples.write(out, rendered, opts)
    prepared["tokenizer"].save(out)
    for name, text in prepared["fmt"].files().items():  # the chat template training brings into the run
        (out / name).write_text(text, encoding="utf-8")
    text_bytes = sum(os.path.getsize(f) for s in sources for f in s.files)
    return prepare_samples.metadata(opts, prepared, inputs_fingerprint, text_bytes)


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / f".{META}.tmp"
    with open(tmp, "w") as f:
        f.write(json_text(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / META)
