"""What a model is trained to do (`model.task`): `task.py` (the table of tasks: each one's labels, transformers Auto
class, throughput units; the one label shift a causal LM's dict batch needs), one module per task (registry.py lists
them), and what a task's own data needs: `image_folder.py` (an imagefolder, for image classification) and
`class_names.py` (the class names kept with the run).

task.py sits on the ground floor (errors, losses, config.fields only); the rest of tasks/ may read data with data/
and config/, never a model, an engine or the trainer (tests/test_structure.py's floors).
"""
