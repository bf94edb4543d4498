"""Pipeline (model) parallelism: split a model into stages by module name (split.py) and run them on several
devices in one process (executor 1, inprocess.py) or one stage per process (executor 2, distributed.py).

Which one runs (parallel/build.py): `parallel.stage_devices` given -> executor 1 in every process (DDP across
processes); not given and more than one process -> executor 2. The trainer prints the engine's name at start.
"""
