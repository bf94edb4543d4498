"""Never losing work: atomic checkpoints that every rank writes its part of (`checkpointer.py`), their manifest and
verification (`manifest.py`), a run's checkpoints in the order of their manifests' steps and pruning (`listing.py`),
each rank's tensors through torch DCP as safetensors (`storage.py`), a rank's state by parameter name
(`named_state.py`: `RankState`, what loads into any topology), the training state beside the tensors
(`train_state.py`), whole weights from a checkpoint (`export.py`) and files written whole or not at all when a disk
fills up (`disk.py`), and the one writer of what a user keeps: each folder lists its files' sha256, and nothing the
template did not write, or that changed since, is replaced (`writer.py`). Every JSON file goes through the one writer
on the ground floor (core/json_text.py: no NaN or Infinity, null).

May import: core, config, errors, faults, models (ties). Never an engine or the trainer: engines hand
checkpoints a `RankState`.
"""
