"""Every way of distributing the work, behind one interface (`engine.py`: what differs between topologies):

    build.py            which engine runs a config and a launch
    ddp_engine.py       data parallel: DDP (or DeepSpeed) through Accelerate
    mesh_engine.py      FSDP2, HSDP, tensor parallel on a device mesh (`mesh.py`, cut by `sharding.py`)
    pipeline/           model parallel: stages in one process or one per process
    precision.py        autocast, the fp16 loss scaler, FSDP2's precision policy
    model_init.py       the meta-device start: each rank fills only what it holds
    parts.py            a model's parts by name (pipeline units, FSDP blocks)
    accelerator.py, launch_env.py, elastic.py   the launch: the Accelerator, the launcher's environment, restarts
    memory_estimate.py  memory per rank before launching (activation_memory.py: what a forward keeps, measured)

May import: core, config, models, checkpoint (RankState), errors, losses. Never the trainer, the step or evaluation.
"""
