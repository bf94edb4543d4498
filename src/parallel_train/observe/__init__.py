"""What a run shows: metrics.jsonl and the trackers (`tracking.py`), the tokens/s meter, MFU and speed settings
(`perf.py`), the loss picture (`plots.py`), its printed lines (`messages.py`) and text generated from a trained run
(`generation.py`, for scripts/sample.py).

May import: config, data, checkpoint, models, errors. Never an engine or the trainer.
"""
