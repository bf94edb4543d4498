"""The ground floor's shared pieces, which every room above may import: small agreements between ranks
(`collectives.py`: `from_rank0`, `all_gather`, ...), the one JSON writer of every file (`json_text.py`: null, never NaN
or Infinity), how a config key is declared and checked (`fields.py`), the keys every model has (`model_config.py`:
`ModelConfig`; each model adds its own beside it) and the table of tasks `model.task` may name (`task.py`: each one's
labels, transformers Auto class, throughput units; the one label shift a causal LM's dict batch needs).

May import: errors, losses (the task's loss). Nothing else of the package: everything else stands on this floor.
"""
