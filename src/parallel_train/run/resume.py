"""Which checkpoint a run continues from: one choice, made by rank 0 and taken by every rank.

The choice is made after the process group exists. Rank 0 lists `checkpoints/` and tries them newest first;
every rank takes its list, so ranks that list the folder differently (a stale NFS directory cache on another
node) can no longer resume from different steps and hang later. Each candidate is verified by all ranks
together (checkpoint_manifest.verify_spread): rank 0 checks the layout and refuses pickles, each rank hashes only
its share of the files, and every rank checks that it sees every file. A rank that cannot see a file of the
chosen checkpoint stops the run with one line naming that rank and the file, on every rank at once.

`resume=auto` never starts a run over: when `checkpoints/` holds checkpoints and none of them verifies, the run
stops with one line naming each one and what is wrong with it, and nothing in output_dir is deleted or written.
With no checkpoint at all (a first launch, or a run killed before its first save) it starts fresh; a run that
finished there is not started again (run/finished.py decides that before this module is asked). Checkpoints are
taken in the order of the steps their manifests record: a folder whose name says another step (copied or renamed)
is skipped with a notice (checkpoint/listing.py), and when only such folders are there the run stops in one line.

Works without a process group too (scripts, one process): rank 0 is then every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.listing import list_checkpoints, misnamed_notice, scan
from parallel_train.checkpoint.manifest import MANIFEST, verify_spread
from parallel_train.checkpoint.train_state import TrainingState
from parallel_train.core.collectives import from_rank0
from parallel_train.errors import UserError
from parallel_train.models.hf_lora import check_same_base
from parallel_train.run.resume_config import SCHEDULE, apply_schedule, change_notice


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def newest_first(root: Path) -> tuple[list[Path], list[str]]:
    """Rank 0: a checkpoints/ folder's checkpoints, newest first by their manifests' steps, and a notice for each
    folder whose name disagrees with its manifest (checkpoint/listing.py: never taken, never pruned)."""
    found, misnamed = scan(root)
    if misnamed and not found:  # resume=auto never starts a run over, not even past checkpoints it will not take
        each = ", ".join(f"{folder.name} holds step {step}" for folder, step in misnamed)
        raise UserError(
            f"resume=auto: {root} holds no checkpoint whose name is its step ({each}: copied or renamed?), so the run does "
            "not start over: continue from one with resume=PATH (it resumes at the step it holds), or start afresh with "
            "a new output_dir; nothing in output_dir was changed"
        )
    return list(reversed(found)), [misnamed_notice(folder, step) for folder, step in misnamed]


def candidates(resume: str, root: Path) -> tuple[list[Path], bool, list[str]]:
    """Rank 0: the checkpoints to try, newest first, whether the user named one (then it must verify), and the
    notices about folders left out."""
    if resume == "auto":
        paths, notices = newest_first(root)
        return paths, False, notices
    path = Path(resume)
    if not path.exists():
        raise UserError(f"resume: no such checkpoint {resume!r}; use resume=auto, resume=none or a checkpoints/step_* folder")
    if path.is_dir() and not (path / MANIFEST).exists() and list_checkpoints(path / "checkpoints"):
        paths, notices = newest_first(path / "checkpoints")  # a run folder: its newest valid one
        return paths, False, notices
    if not path.is_dir():
        raise UserError(f"resume: {resume!r} is not a valid checkpoint (not a folder)")
    return [path], True, []  # its own step, whatever its name says: loading reads the step from trainer_state.json


def choose_checkpoint(resume: str, root: Path, warn: Callable[[str], None]) -> Path | None:
    """`none` -> None; `auto` -> the newest checkpoint in `root` that verifies, None when there is none, an error
    when there are some and none verifies; a path -> that checkpoint (or a run folder's newest), verified.
    A collective: every rank calls it and gets the same answer, or the same UserError."""
    if resume == "none":
        return None
    rank, world = rank_and_world()
    plan: dict | None = None
    if rank == 0:
        try:
            paths, named, notices = candidates(resume, root)
            plan = {"paths": [str(p) for p in paths], "named": named, "notices": notices}
        except UserError as e:
            plan = {"error": str(e)}
    plan = from_rank0(plan)
    if "error" in plan:
        raise UserError(plan["error"])
    for notice in plan["notices"]:
        warn(notice)
    skipped: list[tuple[Path, str]] = []
    for path in map(Path, plan["paths"]):
        problem = verify_spread(path, rank, world)
        if problem is None:
            for older, why in skipped:  # said only when the run goes on: otherwise the error line names them all
                warn(f"skipping checkpoint {older}: {why}")
            return path
        if plan["named"]:
            raise UserError(f"resume: {resume!r} is not a valid checkpoint ({problem})")
        skipped.append((path, problem))
    if skipped:
        where, each = Path(plan["paths"][0]).parent, "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise UserError(
            f"resume=auto: no checkpoint in {where} verifies ({each}), so the run does not start over: "
            "continue from a checkpoint you trust with resume=PATH, or start afresh with a new output_dir; "
            "nothing in output_dir was changed"
        )
    return None


def resumed_state(
    checkpoint: Path | None, engine, scheduler, precision, changes: dict, learning_rate: float, base_model, world: tuple[int, int], say
) -> TrainingState:
    """The training state a run continues with: a fresh one, or `checkpoint`'s, its weights, optimizer, schedule and RNG
    restored into `engine`, `scheduler` and `precision` (a collective: every rank calls it). `changes`: the config's
    since the checkpoint (run/resume_config.py; a new learning rate applies from here); `base_model`: the LoRA base
    the adapters need; `world`: this launch's processes and global batch, checked against the checkpoint's. The state
    says this launch's from here on."""
    state = TrainingState()
    if checkpoint is not None:
        saved = checkpointer.read_json(checkpoint / "trainer_state.json").get("base_model")
        if notice := check_same_base(saved, base_model, checkpoint):  # before its adapters are loaded
            say(notice)
        state = checkpointer.load(checkpoint, engine, scheduler, precision)
        say(f"[parallel_train] resumed from {checkpoint} at step {state.step}")
        if any(key in SCHEDULE for key in changes):
            apply_schedule(scheduler, learning_rate)
        if notice := change_notice(changes, state.step):
            say(notice)
        if notice := checkpointer.topology_notice(state, *world):
            say(notice)
    state.world_size, state.global_batch = world
    state.base_model = base_model
    return state
