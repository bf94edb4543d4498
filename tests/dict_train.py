"""train.py with data sources and models of a user's own, registered the way docs/guide.md says: the tests' fixture
for dict batches (tests/test_dict_batches.py).

    python tests/dict_train.py data.source=windows_dicts KEY=VALUE ...   (any train.py key)

Sources (DATA_SOURCES, data/sources.py), each from the default corpus cut as the `text` source cuts it, with windows
one token shorter than model.block_size, so that a dict's input ids (the whole window, transformers' convention)
fit the model:
    windows_dicts    {"input_ids": window, "labels": window}: a causal LM's labels are its input ids; the template
                     shifts them once (core/task.py's align), so the last position learns nothing
    windows_tuples   the same windows as the template's (inputs, targets) tuples: inputs = window[:-1],
                     targets = window[1:]. The same targets as windows_dicts, one input token less (a causal model's
                     logits at a position see nothing after it): the same losses
    padded_dicts     windows_dicts with sample i's first i % 5 tokens left padding: attention_mask 0, labels -100
    typed_dicts      windows_dicts with a `token_type_ids` input (all zeros), which no causal-LM forward takes
    label_dicts      windows_dicts with the labels under `label`, the name Hugging Face datasets give a class column
    beyond_dicts     windows_dicts whose last input id is the vocabulary's size: beyond the embedding
Models (MODELS, models/__init__.py):
    no_logits        model.name=gpt whose forward returns {"hidden": ...}: a dict without the logits
    takes_any        model.name=gpt whose forward takes any input (**inputs) and uses none of them
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # as train.py: run from a clone

from parallel_train.data.sources import DATA_SOURCES  # noqa: E402
from parallel_train.data.text import Data, build_datasets  # noqa: E402
from parallel_train.losses import IGNORE_INDEX  # noqa: E402
from parallel_train.models import MODELS  # noqa: E402
from parallel_train.models.gpt import GPT  # noqa: E402

PAD = 0


class WindowDicts(Dataset):
    """Each (inputs, targets) window of `windows` as one dict of the whole window; `pad`: left-pad sample i with
    i % 5 tokens; `extra`: add a token_type_ids input."""

    def __init__(self, windows: Dataset, pad: bool = False, extra: bool = False, label: bool = False, beyond: int = 0):
        self.windows, self.pad, self.extra, self.label, self.beyond = windows, pad, extra, label, beyond

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.windows[i]
        ids = torch.cat([x, y[-1:]])
        sample = {"input_ids": ids, "labels": ids.clone()}
        if self.pad:
            n = i % 5
            sample["input_ids"] = torch.cat([torch.full((n,), PAD), ids[n:]])
            sample["labels"] = torch.cat([torch.full((n,), IGNORE_INDEX), ids[n:]])
            sample["attention_mask"] = (torch.arange(len(ids)) >= n).long()
        if self.extra:
            sample["token_type_ids"] = torch.zeros_like(ids)
        if self.label:
            sample["label"] = sample.pop("labels")
        if self.beyond:
            sample["input_ids"][-1] = self.beyond
        return sample


def shorter_windows(cfg, vocab) -> Data:
    """The `text` source's data with windows of model.block_size tokens (inputs and targets one shorter)."""
    model = dataclasses.replace(cfg.model, block_size=cfg.model.block_size - 1)
    return build_datasets(dataclasses.replace(cfg, model=model), vocab)


def as_dicts(**options):
    def load(cfg, vocab) -> Data:
        data = shorter_windows(cfg, vocab)
        if options.get("beyond"):
            options["beyond"] = data.vocab_size
        sets = WindowDicts(data.train_set, **options), WindowDicts(data.val_set, **options)
        # collate: torch's default_collate stacks dicts key by key; the shifted labels end in -100: counted.
        return dataclasses.replace(data, train_set=sets[0], val_set=sets[1], all_targets_count=False)

    return load


class NoLogits(GPT):
    """A model whose forward returns a dict without logits, as a user's model might."""

    def forward(self, x, positions=None):
        return {"hidden": super().forward(x, positions)}


class TakesAny(GPT):
    """A model whose forward takes any keyword input (and ignores those it does not name)."""

    def forward(self, x, positions=None, **inputs):
        return super().forward(x, positions)


DATA_SOURCES.update(
    windows_dicts=as_dicts(),
    windows_tuples=shorter_windows,
    padded_dicts=as_dicts(pad=True),
    typed_dicts=as_dicts(extra=True),
    label_dicts=as_dicts(label=True),
    beyond_dicts=as_dicts(beyond=True),
)
MODELS.update(no_logits=NoLogits, takes_any=TakesAny)

if __name__ == "__main__":
    from parallel_train.cli import main
    from parallel_train.errors import run_cli

    run_cli(main)
