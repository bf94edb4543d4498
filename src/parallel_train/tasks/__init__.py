"""What a model is trained to do (`model.task`): `task.py` (the table of tasks: each one's labels, transformers Auto
class, throughput units; the one label shift a causal LM's dict batch needs), one module per task (registry.py lists
them), and what a task's own data needs: `image_folder.py` (an imagefolder, for image classification),
`text_rows.py` (the rows, columns, tokenizer and encoding of the text tasks) and `label_names.py` (class names from
the data, kept with the run and checked on resume).

task.py sits on the ground floor (errors, losses, config.fields only); the rest of tasks/ may read data with data/
and config/, never a model, an engine or the trainer (tests/test_structure.py's floors).
"""
