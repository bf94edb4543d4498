"""What a model is trained to do (`model.task`): one module per task (registry.py lists them), and what a task's
own data needs: `image_folder.py` (an imagefolder, for image classification), `text_rows.py` (the rows, columns,
tokenizer and encoding of the text tasks) and `label_names.py` (class names from the data, kept with the run and
checked on resume).

The table of tasks (core/task.py: each one's labels, transformers Auto class, throughput units) sits on the ground
floor, where the models read it. tasks/ may read data with data/ and config/, never an engine or the trainer
(tests/test_structure.py's floors).
"""
