"""`train.py`'s command line: --help, config loading, then the training run."""

from __future__ import annotations

import sys

from parallel_train.config import help_text, load_config
from parallel_train.data_sources import check_source
from parallel_train.messages import quiet_third_party


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    quiet_third_party()
    cfg, config_path = load_config(argv)
    check_source(cfg)  # the data registry: a config file cannot know which sources a clone added
    from parallel_train.trainer import run  # not at the top: its imports (accelerate, ...) cost seconds that bad input need not wait

    return run(cfg, config_path)
