"""What a resumed run may change in its config, and how the changes take effect.

A checkpoint continues one run. Its `config.yaml` is compared with the config of the run that resumes it:

- keys that say how long or how fast the run goes, how it is launched, and what it keeps and reports may change
  (`MAY_CHANGE`); they apply from the resumed step, and one notice lists them. A new learning rate or schedule
  replaces the checkpoint's in the optimizer and the LR scheduler at once (`apply_schedule`): the first resumed
  step already uses it, and config.yaml records what runs;
- every other key defines the run (the model, the tokenizer and data split, the optimizer and its
  hyperparameters, the seed): a different value stops the run in one line that names it and lists the keys that
  may change, before anything is loaded or written. Such a change is a new run: a new output_dir.

The list is in docs/configuration.md#what-may-change-on-resume; a test reads it from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from parallel_train.config.load import flatten  # {"train": {"lr": 1}} -> {"train.lr": 1}, as configs are read
from parallel_train.config.sections import Config
from parallel_train.config.usage import is_read
from parallel_train.errors import UserError
from parallel_train.tasks.class_names import check_resumed as check_resumed_classes

SCHEDULE = (
    "train.learning_rate",
    "train.min_lr",
    "train.lr_schedule",
    "train.warmup_steps",
    "train.lr_decay_steps",
    "train.lr_decay_fraction",
)
MAY_CHANGE = (
    "train.max_steps",
    *SCHEDULE,
    "train.log_interval",
    "eval.interval",
    "checkpoint.interval",
    "tracker",
    # how the run is launched (the global batch: topology_notice says what it does to the data order)
    "parallel.*",
    "train.batch_size",
    "train.gradient_accumulation_steps",
    "train.mixed_precision",
    "train.compile",
    "train.tf32",
    "train.peak_tflops",
    "data.num_workers",
    "data.verify",
    "model.activation_checkpointing",
    "model.selective_ac",
    # what it keeps and reports, and its safety rails
    "checkpoint.keep",
    "checkpoint.keep_best",
    "checkpoint.async",
    "eval.iters",
    "eval.batch_size",
    "train.grad_clip",
    "train.max_skipped_steps",
    # where: another corpus is read with the run's tokenizer (data/text.py checks that it fits)
    "data.path",
    "output_dir",
    "resume",
)


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in MAY_CHANGE)


def saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The flat config a checkpoint was written with (verified with the checkpoint, read with yaml.safe_load: data only)."""
    path = checkpoint / "config.yaml"
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        raise UserError(f"resume: {path} is not a config this template wrote; resume from another checkpoint")
    return flatten(data)


def differences(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """key -> (the saved flat config's value, this run's) for every key both have and that differs."""
    now = flatten(cfg.to_dict())
    # A key this run does not read (config/usage.py: train.weight_decay under SGD) defines nothing; the key that
    # decides whether it is read (train.optimizer) is compared itself.
    return {k: (saved[k], now[k]) for k in sorted(now.keys() & saved.keys()) if saved[k] != now[k] and is_read(cfg, k)}


def config_changes(checkpoint: Path, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """key -> (checkpoint's value, this run's) for every key that changed and may change; raises UserError naming
    the keys that may not. Keys one of the two configs lacks (another model's, another version's) are not compared."""
    saved = saved_config(checkpoint)
    if saved is None:
        return {}
    changed = differences(saved, cfg)
    refused = [k for k in changed if not may_change(k)]
    if refused:
        what = ", ".join(f"{k} ({changed[k][0]!r} in the checkpoint, {changed[k][1]!r} now)" for k in refused)
        raise UserError(
            f"resume: {what} cannot change when a run resumes ({checkpoint}); keys that may: {', '.join(MAY_CHANGE)}. "
            "Put the key back, or start a new run in a new output_dir"
        )
    return {k: v for k, v in changed.items() if k not in ("output_dir", "resume")}


def change_notice(changes: dict[str, tuple[Any, Any]], step: int) -> str | None:
    if not changes:
        return None
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    return f"notice: resumed with {listed}: they apply from step {step + 1}"


def apply_schedule(scheduler, learning_rate: float) -> None:
    """After a checkpoint is loaded: the learning rate and schedule of this run's config, from the resumed step.
    Loading restored the checkpoint's base LR (the scheduler's base_lrs, each param group's initial_lr) and the LR
    of its last step; the schedule's shape comes from this config already (its lambda is not saved)."""
    optimizer = scheduler.optimizer
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def check_same_files(checkpoint: Path, files: dict[str, str]) -> None:
    """A resumed run renders its samples as the checkpoint's run did: the same chat template (Data.files), else the
    masks of what it learns would change mid-run; and the same class names, else every label id would change meaning."""
    check_resumed_classes(checkpoint, files)
    template = "chat_template.jinja"
    saved = checkpoint / template
    if template in files and saved.is_file() and saved.read_text(encoding="utf-8") != files[template]:
        raise UserError(
            f"data.chat_template: the resumed run trained with another chat template ({saved}); resume with that one "
            "(data.chat_template=FILE) or start a new output_dir"
        )
