"""Tokenizers: text <-> token ids, behind one interface, and `load_tokenizer`, the one way to get one.

Kinds (`data.tokenizer`, `scripts/prepare_data.py --tokenizer`):
    char        one id per character of the corpus (built from it)            saved as vocab.json
    byte        one id per UTF-8 byte (256 ids)                                saved as vocab.json
    bpe:N       a byte-level BPE of N ids trained on the corpus (Hugging Face `tokenizers`)
    word        one id per whitespace-separated word of the corpus, plus <eos> at every line end and <unk>
                for words it never saw (a `tokenizers` WordLevel model, as pytorch/examples' word_language_model)
    PATH        a tokenizer.json, or a folder holding one (an AutoTokenizer-style folder), or a folder
                where a run or a prepared dataset saved its tokenizer
    NAME        a Hugging Face Hub tokenizer (e.g. gpt2), when online
The Hugging Face kinds are saved as tokenizer.json. Every tokenizer has `encode(str) -> int64 ids`,
`decode(ids) -> str`, `size`, `eot` (the id that ends a document, or None), `files()` (what `save(folder)`
writes) and `fingerprint` (the sha256 of those files: two tokenizers with the same fingerprint give the
same ids). A run saves its tokenizer next to its weights and in every checkpoint, so a resumed run and
scripts/sample.py use the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

VOCAB_FILE, HF_FILE = "vocab.json", "tokenizer.json"
# What a trained byte-level BPE puts between documents; tokenizer.json files from elsewhere are searched for these.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
KINDS = "char, byte, bpe:N, word, a tokenizer.json, a folder holding one, or a Hub tokenizer name"
WORD_EOL, WORD_UNK = "<eos>", "<unk>"  # the word tokenizer's end of line (also its end of a document) and unknown word
MAX_BPE = 1 << 24


class TokenizerFiles:
    """What every tokenizer shares: saving its files and a fingerprint of them."""

    def files(self) -> dict[str, str]:  # file name -> text
        raise NotImplementedError

    def save(self, folder: Path) -> None:
        for name, text in self.files().items():
            tmp = Path(folder) / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, Path(folder) / name)  # never half a file

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, text in sorted(self.files().items()):
            h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
        return h.hexdigest()


@dataclass
class CharVocab(TokenizerFiles):
    """Character vocabulary built from the corpus (sorted, so the same corpus gives the same ids)."""

    chars: list[str]
    kind = "char"  # class attributes, not fields
    eot = None  # documents are separated by a newline

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
        return "".join(self.chars[i] for i in ids if i < len(self.chars))  # padded ids have no character

    def to_json(self) -> str:
        return json_text({"kind": "char", "chars": self.chars}, ensure_ascii=False)

    def files(self) -> dict[str, str]:
        return {VOCAB_FILE: self.to_json()}

    @classmethod
    def load(cls, path: Path) -> CharVocab:
        return cls(json.loads(path.read_text())["chars"])


class ByteVocab(TokenizerFiles):
    """One id per UTF-8 byte (data.tokenizer=byte): any text encodes, nothing to build or to save but the kind."""

    kind, size, eot = "byte", 256, None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # padded ids have no byte

    def to_json(self) -> str:
        return json_text({"kind": "byte"})

    def files(self) -> dict[str, str]:
        return {VOCAB_FILE: self.to_json()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteVocab)


class HFTokenizer(TokenizerFiles):
    """A Hugging Face `tokenizers.Tokenizer` (a trained bpe:N or word, a tokenizer.json, a Hub tokenizer)."""

    kind = "hf"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # The largest id + 1, not the number of tokens: a vocabulary with gaps in its ids must still fit the embedding.
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eot = next((i for i in map(tokenizer.token_to_id, END_OF_TEXT) if i is not None), None)

    def problem(self) -> str | None:
        """What makes this tokenizer fail on some text, or None: an unk token (what an unknown word or character
        becomes) that its vocabulary lacks, which `tokenizers` reports only when it meets such a word, mid-data."""
        unk = getattr(self.tokenizer.model, "unk_token", None)
        if unk is not None and self.tokenizer.token_to_id(unk) is None:
            return f"its unk token {unk!r} is not in its vocabulary; add it to model.vocab in the file, or remove unk_token"
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust side runs them in parallel unless TOKENIZERS_PARALLELISM=false)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.size], skip_special_tokens=False)

    def files(self) -> dict[str, str]:
        return {HF_FILE: self.tokenizer.to_str()}


Tokenizer = CharVocab | ByteVocab | HFTokenizer


# ---------------------------------------------------------------- building and loading


def bpe_size(spec: str) -> int | None:
    """N for `bpe:N`, None for any other spec; a malformed bpe spec is a one-line error."""
    if not spec.startswith("bpe"):
        return None
    head, _, n = spec.partition(":")
    if head != "bpe" or not n.isdigit() or not 257 <= int(n) <= MAX_BPE:
        raise UserError(f"tokenizer {spec!r}: write bpe:N with N in [257, {MAX_BPE:,}] (256 byte ids + merges), e.g. bpe:8192")
    return int(n)


def check_spec(spec: str, key: str = "data.tokenizer") -> None:
    """What can be checked without loading: the spec is not empty and a bpe spec is well formed."""
    if not spec.strip():
        raise UserError(f"{key}: must not be empty; give {KINDS}")
    try:
        bpe_size(spec)
    except UserError as e:
        raise UserError(f"{key}: {e}") from None
    if ":" in spec and not spec.startswith("bpe") and not Path(spec).exists():
        raise UserError(f"{key}: unknown tokenizer kind {spec.split(':')[0]!r}; give {KINDS}")


def needs_corpus(spec: str) -> bool:
    """char, word and bpe:N are built from the corpus; the others exist on their own."""
    return spec in ("char", "word") or bpe_size(spec) is not None


def train_bpe(batches: Iterable[list[str]], vocab_size: int, length: int | None = None) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` ids (256 bytes, <|endoftext|>, merges) trained on batches of texts."""
    from tokenizers import Tokenizer as HFCore
    from tokenizers import decoders, models, pre_tokenizers, trainers

    core = HFCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(batches, trainer, length=length)
    return HFTokenizer(core)


def train_word(batches: Iterable[list[str]], length: int | None = None) -> HFTokenizer:
    """A word-level tokenizer (data.tokenizer=word) built from batches of texts: every whitespace-separated word
    its own id (the vocabulary is every word seen, most frequent first), each line break the word <eos>, and <unk>
    for a word it never saw. It is a plain tokenizer.json, which anything that reads one reloads."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFCore

    core = HFCore(models.WordLevel(unk_token=WORD_UNK))
    core.normalizer = normalizers.Replace("\n", f" {WORD_EOL} ")
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Decoding: words joined by spaces (WordPiece's decoder with a prefix no word has: text never holds NUL), then
    # each <eos> back to a line break.
    core.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="\x00", cleanup=False), decoders.Fuse(), decoders.Replace(Regex(f" ?{WORD_EOL} ?"), "\n")]
    )
    core.train_from_iterator(batches, trainers.WordLevelTrainer(vocab_size=MAX_BPE, show_progress=False), length=length)
    # <unk> and <eos> first, then the words by frequency, ids without gaps: as the trainer's special tokens, a counted
    # <eos> would take a second id and leave a hole. Plain words, not added tokens, so that a text holding no line
    # break still has <eos> for the end of a document.
    vocab = {WORD_UNK: 0, WORD_EOL: 1}
    for word, _ in sorted(core.get_vocab().items(), key=lambda item: item[1]):
        vocab.setdefault(word, len(vocab))
    core.model = models.WordLevel(vocab, unk_token=WORD_UNK)
    return HFTokenizer(core)


def load_hf_file(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as HFCore

    try:
        tokenizer = HFTokenizer(HFCore.from_file(str(path)))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise UserError(f"tokenizer {path}: not a readable tokenizer.json ({str(e).splitlines()[0][:160]})") from None
    return checked(tokenizer, str(path))


def checked(tokenizer: HFTokenizer, where: str) -> HFTokenizer:
    """The tokenizer, if it can encode any text; else a one-line error naming `where` it came from."""
    if (problem := tokenizer.problem()) is not None:
        raise UserError(f"tokenizer {where}: {problem}")
    return tokenizer


def load_saved(folder: Path) -> Tokenizer | None:
    """The tokenizer a run, a checkpoint or a prepared dataset saved in `folder` (tokenizer.json or vocab.json), or None."""
    folder = Path(folder)
    if (folder / HF_FILE).is_file():
        return load_hf_file(folder / HF_FILE)
    if (folder / VOCAB_FILE).is_file():
        return load_vocab(folder / VOCAB_FILE)
    return None


def load_vocab(path: Path) -> CharVocab | ByteVocab:
    """The char or byte vocabulary in a vocab.json file this template wrote."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON; is it a vocabulary this template wrote?") from None
    if isinstance(saved, dict) and saved.get("kind") == "byte":
        return ByteVocab()
    if isinstance(saved, dict) and isinstance(saved.get("chars"), list):
        return CharVocab(saved["chars"])
    raise UserError(f"{path}: not a vocabulary this template wrote (a Hugging Face folder needs its tokenizer.json)")


def load_tokenizer(spec: str, corpus: Callable[[], Iterable[list[str]]] | None = None) -> Tokenizer:
    """The tokenizer a spec names: char, byte, bpe:N, word, a tokenizer.json, a folder (a Hugging Face model or
    tokenizer folder, a run, a checkpoint, a prepared dataset), or a Hub tokenizer name.

    char, word and bpe:N are built from `corpus`, a function returning an iterable of batches of texts (it is
    called once per pass); without one they are an error. Every failure is a one-line UserError.
    """
    spec = str(spec)
    check_spec(spec, key="tokenizer")
    if spec == "byte":
        return ByteVocab()
    if needs_corpus(spec):
        if corpus is None:
            raise UserError(
                f"tokenizer {spec!r} is built from a corpus; prepare the data first (scripts/prepare_data.py) or give a saved one"
            )
        if spec == "word":
            return train_word(corpus())
        n = bpe_size(spec)
        if n is None:
            return CharVocab(sorted(set().union(*(set("".join(batch)) for batch in corpus()))))
        return train_bpe(corpus(), n)
    path = Path(spec)
    if path.is_file():
        return load_vocab(path) if path.name == VOCAB_FILE else load_hf_file(path)
    if path.is_dir():
        return _saved_or_error(path, spec)
    return _from_hub(spec)


def _saved_or_error(folder: Path, spec: str) -> Tokenizer:
    tokenizer = load_saved(folder)
    if tokenizer is None:
        raise UserError(f"tokenizer {spec!r}: {folder} holds no tokenizer.json or vocab.json")
    return tokenizer


def _from_hub(name: str) -> HFTokenizer:
    from tokenizers import Tokenizer as HFCore

    try:
        tokenizer = HFTokenizer(HFCore.from_pretrained(name))
    except Exception as e:  # offline, no such repository, no tokenizer.json in it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"tokenizer {name!r}: not {KINDS} that could be loaded ({first})") from None
    return checked(tokenizer, repr(name))
