"""What a user's own dict batches hold, checked at start before the first step (issue 34, kind 7): HF's `label` key
taken as `labels`, as its collators rename it, and labels, token ids and rows the model cannot take each one line
naming the key, the value found and the bound (before: an IndexError or a cross-entropy error inside step 1).

In process: the check the Trainer runs (data/batch_check.py) on a tiny GPT, a tiny BERT classifier and a tiny ViT.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

import hf_tiny
from parallel_train.config.load import load_config
from parallel_train.data.batch_check import check_first_batches
from parallel_train.data.text import Data, val_loader
from parallel_train.errors import UserError
from parallel_train.models import MODELS
from parallel_train.parallel.model_init import start_model
from parallel_train.tasks.registry import TASKS

VOCAB, BLOCK = 50, 8


class Dicts(Dataset):
    """n samples, each `make(i)`: a dict of unbatched tensors, as a user's dataset returns them."""

    def __init__(self, make, n: int = 6):
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.make(i)


def window(i: int, length: int = BLOCK) -> torch.Tensor:
    return (torch.arange(length) + i) % VOCAB


def gpt_run(*more: str):
    cfg, _ = load_config(
        [
            "model.n_layer=1",
            "model.n_head=2",
            "model.n_embd=16",
            f"model.block_size={BLOCK}",
            "train.batch_size=4",
            "data.source=mine",
            *more,
        ]
    )
    return cfg, start_model(MODELS["gpt"], cfg.model, VOCAB, 0)[0]


def check(make, *more: str, task: str = "causal-lm", model=None, label_names=None) -> None:
    cfg, gpt = gpt_run(*more)
    data = Data(Dicts(make), Dicts(make), None, VOCAB, label_names=label_names)
    check_first_batches(model or gpt, data, cfg, TASKS[task], next(iter(val_loader(data, cfg, 1))))


def test_a_label_key_is_taken_as_labels_as_transformers_collators_take_it():
    cfg, _ = gpt_run()
    data = Data(
        Dicts(lambda i: {"input_ids": window(i), "label": window(i)}),
        Dicts(lambda i: {"input_ids": window(i), "label": window(i)}),
        None,
        VOCAB,
    )
    batch = next(iter(val_loader(data, cfg, 1)))
    assert list(batch) == ["input_ids", "labels"] and batch["labels"].shape == (4, BLOCK)
    check(lambda i: {"input_ids": window(i), "label": window(i)})  # and the start's check takes it


BAD = [  # id, sample i, what the one line says
    ("no_labels", lambda i: {"input_ids": window(i)}, "data.source=mine gives batches without 'labels' (keys: input_ids); "),
    (
        "float_labels",
        lambda i: {"input_ids": window(i), "labels": window(i).float()},
        "data.source=mine: the batch's 'labels' are torch.float32; the loss takes class ids: integers (torch.long)",
    ),
    (
        "label_beyond_vocab",
        lambda i: {"input_ids": window(i), "labels": torch.full((BLOCK,), VOCAB + 3)},
        f"data.source=mine: the batch's 'labels' hold {VOCAB + 3}, outside 0..{VOCAB - 1} (the data's vocab_size {VOCAB}) and not -100",
    ),
    (
        "negative_label",
        lambda i: {"input_ids": window(i), "labels": torch.full((BLOCK,), -1)},
        f"the batch's 'labels' hold -1, outside 0..{VOCAB - 1}",
    ),
    (
        "id_beyond_embedding",
        lambda i: {"input_ids": torch.full((BLOCK,), VOCAB + 5), "labels": window(i)},
        f"data.source=mine: the batch's 'input_ids' hold {VOCAB + 5}, beyond the {VOCAB} ids the model embeds (the data's vocab_size {VOCAB})",
    ),
    (
        "rows_too_long",
        lambda i: {"input_ids": window(i, BLOCK + 4), "labels": window(i, BLOCK + 4)},
        f"data.source=mine: the batch's 'input_ids' rows are {BLOCK + 4} long, beyond the model's {BLOCK} positions (model.block_size={BLOCK})",
    ),
    (
        "labels_of_another_shape",
        lambda i: {"input_ids": window(i), "labels": window(i)[:3]},
        "data.source=mine: the batch's 'labels' are of shape (4, 3), 'input_ids' of (4, 8); ",
    ),
    (
        "labels_a_list",
        lambda i: {"input_ids": window(i), "labels": window(i).tolist()},
        "data.source=mine: the batch's 'labels' is a list, not a tensor; a dict batch holds tensors, batch first",
    ),
]


@pytest.mark.parametrize("make, says", [pytest.param(m, s, id=i) for i, m, s in BAD])
def test_a_bad_dict_batch_is_one_line_at_start(make, says):
    with pytest.raises(UserError) as e:
        check(make)
    assert says in str(e.value) and "\n" not in str(e.value), e.value


def test_classification_labels_are_checked_against_the_classes():
    """A sequence classifier: one label per sample, each below the number of classes (the data's label names)."""
    names = ["neg", "pos"]
    ok = lambda i: {"input_ids": window(i), "labels": torch.tensor(i % 2)}  # noqa: E731
    check(ok, task="sequence-classification", label_names=names)
    with pytest.raises(UserError, match=r"'labels' hold 2, outside 0..1 \(the 2 classes of the data's label names\) and not -100"):
        check(lambda i: {"input_ids": window(i), "labels": torch.tensor(2)}, task="sequence-classification", label_names=names)
    with pytest.raises(
        UserError, match=r"'labels' are of shape \(4, 8\), 'input_ids' of \(4, 8\); model.task=sequence-classification takes one"
    ):
        check(lambda i: {"input_ids": window(i), "labels": window(i) % 2}, task="sequence-classification", label_names=names)


def test_a_hub_model_bounds_are_its_configs(tmp_path):
    """model.name=hf: the embedding rows, the positions and the classes are the model folder's config.json's."""
    folder = hf_tiny.save_task_model(hf_tiny.bert_config(), "AutoModelForSequenceClassification", tmp_path / "bert")
    cfg, _ = load_config(["model.name=hf", f"model.hf_path={folder}", "model.task=sequence-classification", "model.block_size=8"])
    model = start_model(MODELS["hf"], cfg.model, hf_tiny.VOCAB, 0)[0]
    rows = hf_tiny.bert_config().max_position_embeddings
    ids = lambda i, n=BLOCK: torch.arange(n) % hf_tiny.VOCAB  # noqa: E731
    check(
        lambda i: {"input_ids": ids(i, rows), "labels": torch.tensor(1)}, "model.block_size=8", task="sequence-classification", model=model
    )
    with pytest.raises(UserError, match=rf"'input_ids' rows are {rows + 1} long, beyond the model's {rows} positions \(model.hf_path"):
        check(lambda i: {"input_ids": ids(i, rows + 1), "labels": torch.tensor(1)}, task="sequence-classification", model=model)
    with pytest.raises(
        UserError,
        match=rf"'input_ids' hold {hf_tiny.VOCAB}, beyond the {hf_tiny.VOCAB} ids the model embeds \(the embedding rows of model.hf_path",
    ):
        check(
            lambda i: {"input_ids": torch.full((BLOCK,), hf_tiny.VOCAB), "labels": torch.tensor(1)},
            task="sequence-classification",
            model=model,
        )
    with pytest.raises(UserError, match=r"'labels' hold 2, outside 0..1 \(num_labels 2 of model.hf_path"):
        check(lambda i: {"input_ids": ids(i), "labels": torch.tensor(2)}, task="sequence-classification", model=model)


def test_labels_beside_inputs_embeds_are_one_per_token():
    """A float main input (inputs_embeds: batch, tokens, width) has no ids to check, and one label per token fits it."""
    check(lambda i: {"inputs_embeds": torch.zeros(BLOCK, 4), "labels": window(i)})
