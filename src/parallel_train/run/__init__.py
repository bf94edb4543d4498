"""A run's folder and what happens to it between launches: a new or empty folder or a run's, checked and locked for
one run at a time (`output_dir.py`), which checkpoint a run continues from, chosen once for every rank (`resume.py`), what a
resumed run may change in its config (`resume_config.py`), the folder an export writes: never a run, a
checkpoint or a user's files (`export_dir.py`; written by checkpoint/writer.py), and a run that finished there launched again
(`finished.py`: nothing to train, or refused; never trained again from step 0).

May import: core, config, checkpoint, errors, and the names of the files a run writes (data, tasks,
observe). Never an engine or the trainer.
"""
