"""train.py with a data source of dict batches for every model.task, registered as a user registers one.

    python tests/task_data.py data.source=task_batches model.name=hf model.task=seq2seq model.hf_path=... KEY=VALUE ...

A user's way in (data/sources.py's docstring): a loader `(Config, saved tokenizer or None) -> Data`, one line in
DATA_SOURCES, then the template's own entry point. The samples are random token ids (or pixels) padded to
model.block_size, with labels fixed by the sample's index: what tests/test_hf_tasks.py trains on every task while the
task data readers (tasks/*.py `load`) are built elsewhere. Every rank makes the same samples (seeded by index).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from parallel_train.cli import main  # noqa: E402
from parallel_train.data.sources import DATA_SOURCES  # noqa: E402
from parallel_train.data.text import Data  # noqa: E402
from parallel_train.data.tokenizers import load_tokenizer  # noqa: E402
from parallel_train.errors import run_cli  # noqa: E402
from parallel_train.losses import IGNORE_INDEX  # noqa: E402

LABELS = ["negative", "positive", "neutral"]
TRAIN, VAL = 32, 8  # samples


def text_sample(task: str, i: int, T: int, vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One sample of a text task: ids 3.. (0 pads), a real length of T/2..T, labels as the task aligns them."""
    n = int(torch.randint(T // 2, T + 1, (1,), generator=g))
    ids = torch.zeros(T, dtype=torch.long)
    ids[:n] = torch.randint(3, vocab, (n,), generator=g)
    mask = (torch.arange(T) < n).long()
    row = {"input_ids": ids, "attention_mask": mask}
    if task == "sequence-classification":
        return {**row, "token_type_ids": torch.zeros(T, dtype=torch.long), "labels": torch.tensor(i % len(LABELS))}
    if task == "token-classification":
        return {**row, "labels": torch.where(mask.bool(), ids % len(LABELS), IGNORE_INDEX)}
    if task == "masked-lm":  # every third real token masked (id 1) and learned
        masked = mask.bool() & (torch.arange(T) % 3 == 0)
        return {**row, "input_ids": torch.where(masked, 1, ids), "labels": torch.where(masked, ids, IGNORE_INDEX)}
    # seq2seq: the target is the source reversed; the decoder reads it shifted right from 0 (decoder_start_token_id)
    target = torch.zeros(T, dtype=torch.long)
    target[:n] = ids[:n].flip(0)
    labels = torch.where(mask.bool(), target, IGNORE_INDEX)
    decoder_ids = torch.cat([torch.zeros(1, dtype=torch.long), target[:-1]])
    return {**row, "decoder_input_ids": decoder_ids, "decoder_attention_mask": mask, "labels": labels}


def sample(task: str, i: int, T: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    if task == "image-classification":  # 16 x 16 RGB, as tests/hf_tiny.py's ViT takes
        return {"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.tensor(i % len(LABELS))}
    return text_sample(task, i, T, vocab, g)


def task_batches(cfg, saved) -> Data:
    task, T = cfg.model.task, cfg.model.block_size
    images = task == "image-classification"
    tokenizer = None if images else (saved or load_tokenizer(cfg.data.tokenizer))
    vocab = 0 if images else min(tokenizer.size, 300)
    train = [sample(task, i, T, vocab) for i in range(TRAIN)]
    val = [sample(task, i, T, vocab) for i in range(TRAIN, TRAIN + VAL)]
    labels = LABELS if task in ("sequence-classification", "token-classification", "image-classification") else None
    return Data(train, val, tokenizer, vocab, inputs="pixel values" if images else "token ids", label_names=labels)


DATA_SOURCES["task_batches"] = task_batches

if __name__ == "__main__":
    run_cli(main)
