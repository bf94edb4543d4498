"""Sequence to sequence (run_translation's and run_summarization's layouts): write the target from the source.

Rows: `source` and `target`; or `translation`, a dict of texts by language (WMT's rows:
{"translation": {"en": ..., "de": ...}}), read with data.source_lang and data.target_lang; or run_summarization's
`text` and `summary`; other names with data.text_columns=[source] and data.label_column=target. Both texts are
encoded with the tokenizer's special tokens (T5's </s>), cut to model.block_size, each side of a batch padded to its
own longest (text_rows.py). The labels are the
target's ids, -100 on its padding; `decoder_input_ids` are the labels shifted right by one, starting with the
model's decoder_start_token_id (model.hf_path's config.json), padding where the labels are -100: what transformers'
seq2seq models build from labels themselves. A model that is not an encoder-decoder (a BERT, a GPT-2) is refused first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.core.task import Task
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.tasks.text_rows import (
    EncodedRows,
    Encoder,
    Rows,
    check_text_columns,
    choose_columns,
    column_texts,
    first_columns,
    read_rows,
    task_data,
    task_tokenizer,
)

NAME = "seq2seq"
LAYOUTS = ((("source",), "target"), (("translation",), None), (("text",), "summary"))


def model_config(path: str) -> dict[str, Any]:
    """model.hf_path's config.json (a local folder's, else the Hub repository's through transformers)."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text(encoding="utf-8"))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path).to_dict()
    except Exception as e:  # offline, no such repository
        raise UserError(f"model.hf_path: could not read {path!r}'s config.json ({str(e).splitlines()[0][:160]})") from None


def decoder_ids(cfg: Any, pad_id: int) -> tuple[int, int]:
    """(decoder_start_token_id, the decoder's padding id) of the run's model."""
    path = getattr(cfg.model, "hf_path", "")
    if not path:
        raise UserError(
            f"model.task={NAME}: the decoder's first input is the model's decoder_start_token_id, read from model.hf_path's "
            f"config.json; model.name={cfg.model.name} has none: use model.name=hf"
        )
    config = model_config(path)
    check_encoder_decoder(config, path)
    start = config.get("decoder_start_token_id")
    if start is None:
        raise UserError(
            f"model.hf_path: {path}'s config.json has no decoder_start_token_id, the first input of the decoder; add it "
            "(a T5 starts with its pad id, a BART with </s>)"
        )
    pad = config.get("pad_token_id")
    return int(start), int(pad) if pad is not None else pad_id


def check_encoder_decoder(config: dict[str, Any], path: str) -> None:
    """An encoder alone (a BERT) or a decoder alone (a GPT-2) has no decoder to feed the target to: one line naming
    what the model is and the tasks it serves, before its missing decoder_start_token_id is asked for."""
    from parallel_train.models.hf_loading import tasks_served

    if config.get("is_encoder_decoder") or NAME in (served := tasks_served(config)):
        return
    kind = config.get("model_type") or "model of no model_type"
    serves = f"; a {kind} serves model.task={', '.join(served[:-1])}{' or ' if served[1:] else ''}{served[-1]}" if served else ""
    raise UserError(
        f"model.task={NAME}: model.hf_path {path!r} is a {kind}, not an encoder-decoder (its config.json has no "
        f'"is_encoder_decoder": true): {NAME} needs one, such as T5 or BART{serves}'
    )


def reads_languages(cfg: Any) -> bool:
    """Whether the rows are translation dicts, read at data.source_lang and data.target_lang: not when a target column
    is read (data.label_column, or the layout data.path's columns choose). config/usage.py asks it before the data is
    read; True where the columns cannot be seen then (the load says what is wrong)."""
    d = cfg.data
    if d.label_column:
        return False
    have = first_columns(d.path)
    if have is None:
        return True
    try:
        return choose_columns(LAYOUTS, d, have, d.path, NAME)[1] is None
    except UserError:
        return True


def texts_of(rows: Rows, part: dict[str, list], split: str, d: Any) -> tuple[list[str], list[str]]:
    """(sources, targets) of the rows: two columns, or each row's translation dict at the two languages."""
    if rows.label is not None:
        return column_texts(rows, part, rows.texts[0], split), column_texts(rows, part, rows.label, split)
    column = part[rows.texts[0]]
    first = column[0] if isinstance(column[0], dict) else {}
    if not d.source_lang or not d.target_lang:
        raise UserError(
            f"data.source_lang and data.target_lang: name the languages of the {rows.texts[0]!r} column to translate "
            f"from and to (its first row has {', '.join(map(str, first)) or 'none'}), e.g. data.source_lang=en data.target_lang=de"
        )
    for i, row in enumerate(column):
        if not isinstance(row, dict) or row.get(d.source_lang) is None or row.get(d.target_lang) is None:
            has = ", ".join(map(str, row)) if isinstance(row, dict) else f"not a dict ({type(row).__name__})"
            raise UserError(
                f"data.path: {rows.where(split, i)}'s {rows.texts[0]!r} has no {d.source_lang!r} or {d.target_lang!r} "
                f"(it has {has}); fix the row or the languages (data.source_lang, data.target_lang)"
            )
    return [str(r[d.source_lang]) for r in column], [str(r[d.target_lang]) for r in column]


def shift_right(labels: np.ndarray, start: int, pad: int) -> np.ndarray:
    """decoder_input_ids: labels moved one position right, `start` first, `pad` where the labels are -100."""
    shifted = np.concatenate([np.full((len(labels), 1), start, dtype=labels.dtype), labels[:, :-1]], axis=1)
    return np.where(shifted == IGNORE_INDEX, pad, shifted)


def load(cfg: Any, saved: Any) -> Any:
    """Data of dict batches: input_ids, attention_mask, decoder_input_ids, labels (B, T)."""
    d = cfg.data
    check_text_columns(d, NAME, (1,))
    rows = read_rows(cfg, LAYOUTS, NAME)
    tokenizer = task_tokenizer(cfg, saved, NAME)
    encoder = Encoder.of(tokenizer, cfg.model.block_size)
    start, pad = decoder_ids(cfg, encoder.pad_id)

    def encoded(part: dict[str, list], split: str) -> EncodedRows:
        sources, targets = texts_of(rows, part, split, d)
        arrays = encoder.arrays(encoder.encode(sources))
        target = encoder.arrays(encoder.encode(targets))
        labels = np.where(target["attention_mask"] == 1, target["input_ids"], IGNORE_INDEX)
        targets = {k: target["attention_mask"].sum(axis=1) for k in ("decoder_input_ids", "labels")}  # the targets' own length
        return EncodedRows({**arrays, "decoder_input_ids": shift_right(labels, start, pad), "labels": labels}, targets)

    return task_data(cfg, tokenizer, rows, encoded(rows.train, "train"), encoded(rows.val, "validation"))


TASK = Task(NAME, "AutoModelForSeq2SeqLM", "input_ids", "tokens", load=load, metrics=("loss", "perplexity", "accuracy"))
