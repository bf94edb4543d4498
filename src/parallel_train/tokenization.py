"""Tokenizers: text <-> token ids. `char` builds a vocabulary from the corpus (one id per character), `byte`
uses the 256 UTF-8 byte values. A run saves its tokenizer as vocab.json, so a resumed run and
scripts/sample.py use the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
