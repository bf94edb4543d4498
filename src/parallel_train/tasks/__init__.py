"""What a model is trained to do (`model.task`): `task.py` (the table of tasks: each one's labels, transformers Auto
class, throughput units; the one label shift a causal LM's dict batch needs).

May import: errors, losses, config.fields. Never a model, the data, an engine or the trainer.
"""
