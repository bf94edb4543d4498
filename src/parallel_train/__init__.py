"""parallel-train: a PyTorch training template for every kind of parallel training, driven by Accelerate.

The house, by floor (lower floors never import higher ones: tests/test_structure.py):

    0  errors, faults, losses, eval_metrics     one-line errors, test-only faults, the loss and the metrics you edit
       core/                                    small agreements between ranks, the JSON writer, how a key is
                                                declared, the keys every model has, the table of tasks
    1  models/                                  the models and their registry
    2  config/, data/, optim, tasks/            the run's keys; what feeds the model; optimizer and schedule; tasks
    3  checkpoint/, observe/, run/              checkpoints and exports; what a run shows; the run's folder
    4  parallel/                                every way of distributing: engines, mesh, sharding, pipelines
    5  step, evaluation, guards                 the one optimizer step, evaluation, stop signals and non-finite steps
    6  trainer, cli                             the training loop and train.py's command line
"""
