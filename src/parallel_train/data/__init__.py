"""What feeds the model: the data sources (`sources.py`: `data.source` -> a loader), the in-memory `text` source and
the loaders every source ends in (`text.py`: `Data`, windows, `train_loader`, `val_loader`), local files, folders and
Hub datasets (`inputs.py`), tokenizers (`tokenizers.py`), the samples of each optimizer step (`batch_sampler.py`,
`permutation.py`), token shards prepared once (`prepare.py`, `prepared.py`) and streams (`streaming.py`).

May import: core, config, errors, losses (IGNORE_INDEX), faults. Never an engine or the trainer.
"""
