"""Masked language modelling (run_mlm's layout, line by line): predict the masked tokens of each text.

Rows: `text` (a .txt file: one row per line; another column with data.text_columns=[c]); a blank row (empty or
whitespace only) is dropped, as run_mlm's line_by_line drops it. Each row is one sample,
encoded with the tokenizer's special tokens ([CLS] text [SEP]), cut to model.block_size and padded as text_rows.py pads
(its mask drawn at model.block_size, so the same whatever its batch's width). Of its tokens
(never a special token or padding) data.mlm_probability are chosen, as transformers'
DataCollatorForLanguageModeling chooses them: 80% become the mask token, 10% a random token, 10% stay; the labels
are the chosen tokens' ids and -100 everywhere else.

The choice is drawn from a generator of the sample's own, seeded by (train.seed, the split, the epoch, the
sample's index), never from the global RNG: a sample is masked the same way on every topology, with any
accumulation and after a resume, and differently in each epoch (dynamic masking, as transformers' collator does);
validation samples are masked the same way at every evaluation.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from parallel_train.core.task import Task
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.tasks.text_rows import (
    EncodedRows,
    Encoder,
    check_text_columns,
    column_texts,
    drop_blank,
    read_rows,
    special_id,
    task_data,
    task_tokenizer,
)

NAME = "masked-lm"
LAYOUTS = ((("text",), None),)
MASK_TOKENS = ("[MASK]", "<mask>", "<|mask|>")


def generator(seed: int, split: str, epoch: int, index: int) -> torch.Generator:
    """The generator of one sample's mask: a function of (seed, split, epoch, index) only."""
    key = hashlib.blake2b(f"{seed}/{split}/{epoch}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def mask_tokens(
    ids: torch.Tensor, special: torch.Tensor, g: torch.Generator, p: float, mask_id: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one sample: a share p of its tokens not `special` chosen; of those 80% masked, 10% random,
    10% kept (one uniform draw decides which); labels -100 except where chosen."""
    chosen = (torch.rand(ids.shape, generator=g) < p) & ~special
    how = torch.rand(ids.shape, generator=g)
    random_ids = torch.randint(vocab_size, ids.shape, generator=g)
    inputs = torch.where(chosen & (how < 0.8), mask_id, ids)
    inputs = torch.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, inputs)
    return inputs, torch.where(chosen, ids, IGNORE_INDEX)


class MaskedRows(EncodedRows):
    """Encoded texts whose batches are masked: input_ids with the chosen tokens replaced, labels at them. Takes
    indices, or stream positions epoch * len + index (the train set: Data.with_epoch)."""

    def __init__(self, arrays: dict[str, np.ndarray], special: np.ndarray, masking: dict[str, Any]):
        super().__init__(arrays)
        self.special, self.masking = torch.from_numpy(special), masking

    def __getitems__(self, positions: list[int]) -> dict[str, torch.Tensor]:
        return self.cut(self.rows(positions), [p % len(self) for p in positions])

    def rows(self, positions: list[int]) -> dict[str, torch.Tensor]:
        """Masked at model.block_size (then cut): a sample's mask is the same whatever its batch's width."""
        drawn = [divmod(p, len(self)) for p in positions]  # (epoch, index)
        batch = super().rows([i for _, i in drawn])
        m = self.masking
        pairs = [
            mask_tokens(ids, self.special[i], generator(m["seed"], m["split"], e, i), m["p"], m["mask_id"], m["vocab_size"])
            for ids, (e, i) in zip(batch["input_ids"], drawn, strict=True)
        ]
        return {**batch, "input_ids": torch.stack([x for x, _ in pairs]), "labels": torch.stack([y for _, y in pairs])}


def load(cfg: Any, saved: Any) -> Any:
    """Data of dict batches: input_ids (masked), attention_mask, labels (B, T)."""
    check_text_columns(cfg.data, NAME, (1,))
    rows = drop_blank(read_rows(cfg, LAYOUTS, NAME))
    tokenizer = task_tokenizer(cfg, saved, NAME)
    mask_id = special_id(tokenizer.tokenizer, MASK_TOKENS)
    if mask_id is None:
        raise UserError(
            f"model.task={NAME}: the tokenizer {cfg.data.tokenizer!r} has no mask token ({', '.join(MASK_TOKENS)}); give a "
            "masked-LM model's tokenizer"
        )
    encoder = Encoder.of(tokenizer, cfg.model.block_size)

    def encoded(part: dict[str, list], split: str) -> MaskedRows:
        encodings = encoder.encode(column_texts(rows, part, rows.texts[0], split))
        arrays = encoder.arrays(encodings)
        special = np.asarray([e.special_tokens_mask for e in encodings], dtype=bool) | (arrays["attention_mask"] == 0)
        masking = dict(seed=cfg.train.seed, split=split, p=cfg.data.mlm_probability, mask_id=mask_id, vocab_size=tokenizer.size)
        return MaskedRows(arrays, special, masking)

    return task_data(cfg, tokenizer, rows, encoded(rows.train, "train"), encoded(rows.val, "validation"), with_epoch=True)


TASK = Task(NAME, "AutoModelForMaskedLM", "input_ids", "tokens", load=load, metrics=("loss", "perplexity", "accuracy"))
