"""A launch into a folder whose run finished: done in one line, or refused; never trained again from step 0.

summary.json is written once, at the end of a run (the trainer's `finish`), and records the config the run finished
with (`summary_config`). A launch with resume=auto into such a folder:

- with the same config (output_dir and resume aside) has nothing to train when no checkpoint is left (they may have
  been deleted to save space) or the newest is at the finished step: one line, exit 0, no file changed;
- otherwise continues from its newest checkpoint as any run does (run/resume_config.py: which keys may change;
  with an older checkpoint, the same config trains the steps after it again);
- with another config and no checkpoint to continue from it stops in one line, because it would train from step 0
  over the finished run's model.safetensors, metrics.jsonl and summary.json.

A summary.json of an earlier version records no config: config.yaml, written by the launch that finished, stands in
for it when its train.max_steps is the summary's steps. A config that cannot be read, or lacks the keys every config
holds (`DEFINING`: an empty or foreign one would compare equal to any launch), says nothing: such a run is never
done, and without a checkpoint to continue from the launch is refused in one line naming summary.json. A
`checkpoints` that is a file is never passed over in silence: the done line says so, and any other launch stops in
one line (its first save would fail).

Rank 0 reads the folder and decides; every rank takes its decision (from_rank0), so every rank exits alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_train.config.load import flatten
from parallel_train.config.sections import Config
from parallel_train.core.collectives import from_rank0, rank
from parallel_train.errors import UserError
from parallel_train.run.resume_config import differences, saved_config

SUMMARY = "summary.json"
NOT_COMPARED = ("output_dir", "resume")  # where the run is and how it was found say nothing about what it trained
DEFINING = ("model.name", "train.max_steps", "train.seed")  # keys every config holds: without them it is none


def summary_config(cfg: Config) -> dict[str, Any]:
    """summary.json's `config`: what a later launch compares itself with."""
    return cfg.to_dict()


@dataclass
class Rerun:
    done: str | None = None  # the line for a finished run with nothing to train: say it, change nothing, exit 0
    refusal: str | None = None  # the error for a finished run that no checkpoint continues

    def done_from(self, checkpoint: Path | None, max_steps: int) -> str | None:
        """The done line when the run finished with this config and nothing is left to train from `checkpoint` (none,
        or one at train.max_steps), else None. A collective when there is a checkpoint: rank 0 reads its step."""
        if self.done is None or checkpoint is None:
            return self.done
        step = from_rank0(saved_step(checkpoint) if rank() == 0 else None)
        return self.done if step is not None and step >= max_steps else None

    def refuse_unless(self, checkpoint: Path | None) -> None:
        if checkpoint is None and self.refusal:
            raise UserError(self.refusal)


def saved_step(checkpoint: Path) -> int | None:
    """The step a checkpoint holds (its trainer_state.json, verified with it), or None when it cannot be read: loading
    it then says what is wrong."""
    try:
        step = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return None
    return step if isinstance(step, int) else None


def meet_finished_run(cfg: Config, out: Path) -> Rerun:
    """What a launch into `out` does about a run that finished there. A collective: every rank gets the same answer,
    or the same UserError. Reads summary.json (and config.yaml) only, on rank 0."""
    decision: dict[str, Any] | None = None
    if rank() == 0:
        try:
            decision = decide(cfg, out)
        except (OSError, UserError) as e:
            decision = {"error": str(e) if isinstance(e, UserError) else f"output_dir: cannot read {out / SUMMARY} ({e.strerror})"}
    decision = from_rank0(decision)
    if "error" in decision:
        raise UserError(decision["error"])
    return Rerun(**decision)


def decide(cfg: Config, out: Path) -> dict[str, Any]:
    root = out / "checkpoints"
    a_file = root.exists() and not root.is_dir()
    finished = finished_run(out) if cfg.resume == "auto" else None
    if finished is not None:
        steps, val_loss, saved = finished
        changes = None if saved is None else {k: v for k, v in differences(saved, cfg).items() if k not in NOT_COMPARED}
        loss = f"val loss {f'{val_loss:.4f}' if isinstance(val_loss, (int, float)) else 'n/a'}"
        if changes == {}:
            note = " (its checkpoints is a file, not a folder)" if a_file else ""
            return {"done": f"[parallel_train] output_dir {out} holds a finished run ({steps} steps, {loss}){note}; nothing to train"}
    if a_file:
        raise UserError(
            f"output_dir: {root} is a file, not the run's folder of checkpoints: move it away, or choose another output_dir; "
            "nothing in output_dir was changed"
        )
    if finished is None:
        return {}
    what = f"{out / SUMMARY} does not say which config it finished with (unreadable, or no config in it)"
    if changes:
        what = "this launch changes " + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    return {
        "refusal": f"resume=auto: output_dir {out} holds a run that finished at step {steps} ({loss}) and no checkpoint to "
        f"continue it from, and {what}: it would train again from step 0 over that run. Continue from a checkpoint of it "
        "with resume=PATH, or start this run in a new output_dir; nothing in output_dir was changed"
    }


def finished_run(out: Path) -> tuple[Any, float | None, dict[str, Any] | None] | None:
    """(its steps, its last val loss, the flat config it finished with or None when unknown), or None when no run
    finished in `out` (no summary.json: a first launch, or a run stopped before its end)."""
    path = out / SUMMARY
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        summary = None
    if not isinstance(summary, dict):  # a run finished here, but what it was cannot be read
        return "?", None, None
    steps, val_loss, config = summary.get("steps"), summary.get("final_val_loss"), summary.get("config")
    if isinstance(config, dict):
        return steps, val_loss, a_config(flatten(config))
    try:  # an earlier version's summary: the launch that finished wrote config.yaml
        earlier = a_config(saved_config(out))
    except UserError:
        earlier = None
    same_run = earlier is not None and earlier.get("train.max_steps") == steps
    return steps, val_loss, earlier if same_run else None


def a_config(flat: dict[str, Any] | None) -> dict[str, Any] | None:
    """`flat` when it holds the keys every config holds, else None (it says nothing about what the run trained)."""
    return flat if flat is not None and all(key in flat for key in DEFINING) else None
