"""The class names of a task with labels (Data.label_names), kept with the run: saved as `label_names.json` beside
the tokenizer in output_dir and in every checkpoint (Data.files), and compared on resume, because label id i means
label_names[i]: data whose classes differ would silently retrain every head row on another class."""

from __future__ import annotations

import json
from pathlib import Path

from parallel_train.errors import UserError

FILE = "label_names.json"


def saved_with_run(names: list[str]) -> dict[str, str]:
    """Data.files for these class names: one JSON list, label id = position."""
    return {FILE: json.dumps(names, ensure_ascii=False) + "\n"}


def check_resumed(checkpoint: Path, files: dict[str, str]) -> None:
    """The resumed run's classes (its label_names.json) are this data's, in the same order."""
    saved = Path(checkpoint) / FILE
    if FILE not in files or not saved.is_file():
        return
    before, now = json.loads(saved.read_text(encoding="utf-8")), json.loads(files[FILE])
    if before == now:
        return
    gone, new = [n for n in before if n not in now], [n for n in now if n not in before]
    what = "; ".join(
        part
        for part in (
            f"missing now: {', '.join(gone[:5])}{' ...' if len(gone) > 5 else ''}" if gone else "",
            f"new: {', '.join(new[:5])}{' ...' if len(new) > 5 else ''}" if new else "",
        )
        if part
    )
    raise UserError(
        f"data.path: the resumed run trained on {len(before)} classes ({saved}), this data has {len(now)} "
        f"({what or 'the same names in another order'}); resume with the data it was trained on, or start a new output_dir"
    )
