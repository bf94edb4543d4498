#!/usr/bin/env python3
"""Draw loss, learning rate and tokens/s against step for one run, or several overlaid.

    python scripts/plot_metrics.py runs/shakespeare_char                    -> runs/shakespeare_char/metrics.png
    python scripts/plot_metrics.py runs/ddp runs/fsdp runs/pipeline           -> runs/compare.png
    python scripts/plot_metrics.py runs/a runs/b --out /tmp/a_vs_b.png

Reads each run's metrics.jsonl; draws headless (no display needed). A default OUT is written as the run writes its
picture (src/parallel_train/checkpoint/writer.py): never over a file the template did not write there; --out is yours.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.checkpoint.writer import write_with  # noqa: E402
from parallel_train.errors import UserError, run_cli  # noqa: E402
from parallel_train.observe.plots import PICTURE, plot_runs  # noqa: E402


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py
        raise UserError(f"{message} (see --help)")


def main() -> int:
    p = Parser(description="Plot the metrics of one or more training runs.")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="output_dir of a run (holds metrics.jsonl)")
    p.add_argument(
        "--out", type=Path, help=f"PNG to write (default: RUN/{PICTURE} for one run, compare.png next to the first run for several)"
    )
    args = p.parse_args(sys.argv[1:])
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            raise UserError(f"{run}: no metrics.jsonl here; give the output_dir of a training run")
    if len(set(r.resolve() for r in args.runs)) != len(args.runs):
        raise UserError("the same run is given twice")
    out = args.out or (args.runs[0] / PICTURE if len(args.runs) == 1 else args.runs[0].parent / "compare.png")
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: give a .png file name")
    print(plot_runs(args.runs, out) if args.out else write_with(out, lambda path: plot_runs(args.runs, path)))
    return 0


if __name__ == "__main__":
    run_cli(main)
