"""The checkpoints of a run's `checkpoints/` folder: which there are, in step order, and which to keep.

A checkpoint is a folder `step_NNNNNNN` whose manifest records its step (checkpoint/manifest.py). The name only
repeats the step, and a name can lie: a folder copied or renamed to another step's name (`step_0099999`) would be
taken as the newest by resume=auto, and pruning by names would then delete the real newer checkpoints. So a folder
whose name and manifest disagree is left out of the listing (resume=auto skips it with a notice, run/resume.py) and is
never pruned; `resume=PATH` to it resumes at the step it holds. Checkpoints of earlier versions record no step in
their manifest: their name is all there is. Listing reads one small JSON file per checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from parallel_train import faults
from parallel_train.checkpoint.manifest import manifest_step

PREFIX = "step_"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def checkpoint_step(folder: Path) -> int | None:
    """The step a `step_NNNNNNN` folder's name says (any number of digits), else None."""
    digits = folder.name[len(PREFIX) :]
    return int(digits) if folder.name.startswith(PREFIX) and digits.isdigit() else None


def scan(root: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """(the checkpoints, oldest first by step; the folders whose name disagrees with their manifest, with its step)."""
    if not root.is_dir():
        return [], []
    found, misnamed = [], []
    for folder in (p for p in root.iterdir() if p.is_dir()):
        named = checkpoint_step(folder)
        if named is None:
            continue
        step = manifest_step(folder)
        if step is not None and step != named:
            misnamed.append((folder, step))
        else:
            found.append((named, folder))  # steps, not names: names sort wrongly past 7 digits
    return [p for step, p in sorted(found) if not faults.hidden(step, listing=True)], sorted(misnamed)  # test-only: a stale listing


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints (renamed from .tmp-*) whose name is their step, oldest first by step."""
    return scan(root)[0]


def misnamed_notice(folder: Path, step: int) -> str:
    return (
        f"skipping checkpoint {folder}: its manifest says step {step}, its name another (copied or renamed?); resume=auto "
        f"never takes it and pruning never deletes it (resume={folder} would continue from step {step})"
    )


def best_checkpoint(root: Path) -> Path | None:
    """The checkpoint with the lowest val loss among those evaluated at their own step."""
    best, best_loss = None, math.inf
    for folder in list_checkpoints(root):
        try:
            st = json.loads((folder / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        loss = st.get("final_val_loss")
        if st.get("final_val_step") == st.get("step") and isinstance(loss, (int, float)) and loss < best_loss:
            best, best_loss = folder, loss
    return best


def prune(root: Path, keep: int, protect: Path | None = None, keep_best: bool = False, upto: int | None = None) -> None:
    """Keep the newest `keep` checkpoints by step up to step `upto` (the one just written), `protect` (the one this run
    resumed from, until a newer one verified), and with `keep_best` the one with the lowest val loss. Checkpoints after
    `upto` (left by a run this one does not continue: resume=PATH to an older step) are not pruned: this run has not
    replaced them yet. A folder whose name and manifest disagree is not listed, so never pruned."""
    spared = {p.resolve() for p in (protect, best_checkpoint(root) if keep_best else None) if p is not None}
    ours = [p for p in list_checkpoints(root) if upto is None or (checkpoint_step(p) or 0) <= upto]
    for old in ours[:-keep]:
        if old.resolve() in spared:
            continue
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
