"""The first batches against what the model takes, at start, before the first step (the Trainer's set-up): the keys
the forward takes (data/batch.py's check_model_takes), and for dict batches (a data source of your own, a task's
loader) the values: `labels` present, integer class ids of the task's shape, each in 0..classes-1 or IGNORE_INDEX;
token ids below the embedding's rows; rows no longer than the model's positions. Each problem is one line naming
the key, the value found and the bound, instead of an IndexError or a cross-entropy error inside step 1.

What is checked: the first validation batch and a batch of the first training samples, the same on every rank (every
rank loads the same data), so every rank stops alike before the first collective. Nothing is checked per step: the
hot path reads no batch on the host (tests/test_host_sync.py), and a batch seen by one rank alone cannot be decided
alike without a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from parallel_train.data.batch import LABELS, check_model_takes, main_key
from parallel_train.data.text import Data, collate_fn
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.models.hf_loading import embedding_rows, max_positions


@dataclass(frozen=True)
class Bounds:
    """What the model takes, each with where it comes from (said in the error line)."""

    vocab: int  # token ids: 0..vocab-1
    vocab_from: str
    classes: int  # labels: 0..classes-1 or IGNORE_INDEX
    classes_from: str
    positions: int | None  # the longest row of token ids; None: no limit known
    positions_from: str


def bounds_of(model: Any, cfg: Any, data: Data, task: Any) -> Bounds:
    """A transformers model's own config.json (embedding rows, positions, num_labels); any other model is built from
    the data's vocab_size (or label names) and model.block_size."""
    per_sample = task.units == "samples" or task.has_labels  # labels are classes, not token ids
    vocab, vocab_from = data.vocab_size, f"the data's vocab_size {data.vocab_size}"
    if per_sample and data.label_names:
        classes, classes_from = len(data.label_names), f"the {len(data.label_names)} classes of the data's label names"
    else:
        classes, classes_from = vocab, vocab_from
    block = getattr(cfg.model, "block_size", None)
    positions, positions_from = block, f"model.block_size={block}"
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):  # model.name=hf: what its config.json says
        where = f"model.hf_path {getattr(model, 'hf_path', '')!r}"
        rows, most = embedding_rows(config), max_positions(config)
        if rows is not None:
            vocab, vocab_from = rows, f"the embedding rows of {where}"
        if most:
            positions, positions_from = most, where
        if per_sample:
            classes, classes_from = config.num_labels, f"num_labels {config.num_labels} of {where}"
        else:
            classes, classes_from = vocab, vocab_from
    return Bounds(vocab, vocab_from, classes, classes_from, positions, positions_from)


def first_train_batch(data: Data, n: int) -> Any:
    """A batch of the first `n` training samples, collated as the train loader collates them; None for a stream."""
    samples = data.train_set
    if samples is None or len(samples) == 0:
        return None
    indices = list(range(min(n, len(samples))))
    drawn = samples.__getitems__(indices) if hasattr(samples, "__getitems__") else [samples[i] for i in indices]
    return collate_fn(data, samples)(drawn)


def check_first_batches(model: Any, data: Data, cfg: Any, task: Any, val_batch: Any) -> None:
    """At start: the first validation batch (`val_batch`) and the first training samples against the model."""
    task_data = task.load is not None and cfg.data.source == "text"
    where = f"model.task={cfg.model.task}'s data" if task_data else f"data.source={cfg.data.source}"
    dicts = [b for b in (val_batch, first_train_batch(data, cfg.train.batch_size)) if isinstance(b, Mapping)]
    for batch in dicts:  # first: the keys' check below reads the labels
        if LABELS not in batch:
            raise UserError(
                f"{where} gives batches without 'labels' (keys: {', '.join(batch)}); name the labels 'labels' (or 'label'), "
                f"{IGNORE_INDEX} where nothing is learned"
            )
        other = next((k for k, v in batch.items() if not isinstance(v, torch.Tensor)), None)
        if other is not None:
            raise UserError(
                f"{where}: the batch's {other!r} is a {type(batch[other]).__name__}, not a tensor; a dict batch holds tensors, batch "
                "first (torch's default_collate stacks a dataset's tensors so, or a collate of your own)"
            )
    check_model_takes(model.forward, val_batch, cfg, task_data)
    bounds = bounds_of(model, cfg, data, task)
    for batch in dicts:
        check_labels(batch, bounds, task, where)
        check_token_ids(batch, bounds, where)
        check_pixels(model, batch, where)


def check_labels(batch: Mapping[str, torch.Tensor], bounds: Bounds, task: Any, where: str) -> None:
    """Integers; one per sample (a task judged per sample) or one per input token; in range."""
    labels, main = batch[LABELS], main_key(batch)
    x = batch[main]
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UserError(
            f"{where}: the batch's 'labels' are {labels.dtype}; the loss takes class ids: integers (torch.long), {IGNORE_INDEX} "
            "where nothing is learned (a regression or multi-label target needs a loss of your own: docs/guide.md section 3)"
        )
    one_per_sample = task.units == "samples"
    # one per input token: (batch, tokens) as the ids, or inputs_embeds' first two; seq2seq's are the target's, of any length
    per_token = labels.dim() == 2 and x.dim() >= 2 and (labels.shape[1] == x.shape[1] or task.name == "seq2seq")
    if not (labels.dim() == 1 if one_per_sample else per_token) or len(labels) != len(x):
        takes = "one class id per sample, (batch,)" if one_per_sample else f"one label per input token, shaped like {main!r}"
        raise UserError(
            f"{where}: the batch's 'labels' are of shape {tuple(labels.shape)}, {main!r} of {tuple(x.shape)}; "
            f"model.task={task.name} takes {takes}"
        )
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= bounds.classes))
    if bad.any():
        raise UserError(
            f"{where}: the batch's 'labels' hold {int(labels[bad][0])}, outside 0..{bounds.classes - 1} ({bounds.classes_from}) "
            f"and not {IGNORE_INDEX} (ignored); give labels in that range"
        )


def check_token_ids(batch: Mapping[str, torch.Tensor], bounds: Bounds, where: str) -> None:
    """Token ids (an integer main input) below the embedding's rows, rows no longer than the model's positions."""
    main = main_key(batch)
    x = batch[main]
    if x.is_floating_point() or x.dim() != 2:  # pixels, feature vectors, embeddings: no ids
        return
    bad = (x < 0) | (x >= bounds.vocab)
    if bad.any():
        raise UserError(
            f"{where}: the batch's {main!r} hold {int(x[bad][0])}, beyond the {bounds.vocab} ids the model embeds ({bounds.vocab_from}); "
            "encode the data with the model's tokenizer, or give a model with that many ids"
        )
    if bounds.positions and x.shape[1] > bounds.positions:
        raise UserError(
            f"{where}: the batch's {main!r} rows are {x.shape[1]} long, beyond the model's {bounds.positions} positions "
            f"({bounds.positions_from}); cut the rows to {bounds.positions} tokens"
        )


def check_pixels(model: Any, batch: Mapping[str, torch.Tensor], where: str) -> None:
    """A transformers vision model's pixel_values: its num_channels, and what its embeddings take (a ViT takes one image
    size alone), tried on one image of the batch's shape, on the meta device where the model starts there (shapes only)."""
    x, hf = batch.get("pixel_values"), getattr(model, "hf", None)
    if x is None or x.dim() != 4 or hf is None:
        return
    path, shape = getattr(model, "hf_path", ""), "x".join(map(str, x.shape[1:]))
    channels = getattr(hf.config, "num_channels", None)
    if channels and x.shape[1] != channels:
        raise UserError(
            f"{where}: the batch's 'pixel_values' have {x.shape[1]} channels ({shape}), but model.hf_path {path!r} takes {channels} "
            f"(num_channels in its config.json); give a model of {x.shape[1]} channels, or an image processor that makes {channels}"
        )
    embeddings = getattr(hf.base_model, "embeddings", None)
    weight = next(embeddings.parameters(), None) if isinstance(embeddings, torch.nn.Module) else None
    if weight is None:
        return
    try:
        with torch.no_grad():
            embeddings(torch.zeros((1, *x.shape[1:]), device=weight.device, dtype=weight.dtype))
    except ValueError as e:  # transformers' own words: "Input image size (64*64) doesn't match model (32*32)."
        said = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{where}: model.hf_path {path!r} cannot take the batch's 'pixel_values' of {shape} ({said}); give its image processor "
            "(preprocessor_config.json) the size the model was made for"
        ) from None
    except Exception:  # noqa: BLE001 (the probe does not fit this model: embeddings that want more, an op without a meta kernel)
        return  # step 1 then says what it says
