"""`train.py`'s command line: --help, config loading, then the training run."""

from __future__ import annotations

import sys

from parallel_train import faults
from parallel_train.config.load import help_text, load_config
from parallel_train.data.sources import check_source
from parallel_train.observe.messages import quiet_third_party
from parallel_train.parallel.launch_env import check_launch_env, end_with_launcher, set_cpu_threads


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    check_launch_env()  # a RANK or WORLD_SIZE left over from another launch: one line, before anything else
    end_with_launcher()  # a SIGKILL of torchrun's agent leaves no worker training on (Linux)
    quiet_third_party()
    cfg, config_path = load_config(argv)
    check_source(cfg)  # the data registry: a config file cannot know which sources a clone added
    faults.user_error(0)  # test-only: one rank's error before the process group exists (a misconfigured node)
    set_cpu_threads()  # before any tensor work: the cores shared among this node's processes, or OMP_NUM_THREADS
    from parallel_train.trainer import run  # not at the top: its imports (accelerate, ...) cost seconds that bad input need not wait

    return run(cfg, config_path)
