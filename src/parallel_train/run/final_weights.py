"""The weights a finished run leaves in output_dir: `model.safetensors` (the whole model under canonical names, one
tensor at a time, from the last checkpoint), and for a model from elsewhere its own format too (`hf/`, a
save_pretrained folder, and `adapter/` for LoRA adapters, written whole beside the old ones and then put in their
place). Both go through checkpoint/writer.py, as scripts/export.py's folders do: a file there the template did not
write, or that changed since, is never replaced; the run stops in one line naming it (run/output_dir.py checks the
same before the run trains)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel_train.checkpoint.disk import write_error
from parallel_train.checkpoint.export import checkpoint_weights, export, load_weights
from parallel_train.checkpoint.listing import checkpoint_name
from parallel_train.checkpoint.writer import check_file, record, write_folders


def own_folders(model_cfg: Any, own_format: Callable | None) -> tuple[str, ...]:
    """The folders a finished run writes in output_dir beside model.safetensors: hf/ for a model from elsewhere
    (`own_format`), and adapter/ too for its LoRA adapters."""
    if own_format is None:
        return ()
    return ("hf", "adapter") if getattr(model_cfg, "lora_rank", 0) else ("hf",)


def final_checkpoint(root: Path, max_steps: int, resumed_from: Path | None) -> Path | None:
    """The checkpoint the final weights come from: train.max_steps's, or the one a run resumed from when it was
    already there (nothing trained, no checkpoint written)."""
    final = root / checkpoint_name(max_steps)
    return final if final.is_dir() else resumed_from


def write_final_weights(
    source: Path, out: Path, model_cfg: Any, own_format: Callable | None, data: Any, labels: list[str] | None
) -> str | None:
    """model.safetensors from checkpoint `source`, then the model's own format (`own_format`: its class's `export`,
    None for the template's own models) in out/hf. Returns the line saying what the own format wrote, or None."""
    check_file(out / "model.safetensors")
    try:
        export(source, out)  # model.safetensors, one whole tensor at a time
    except OSError as e:  # a full disk: export() writes model.safetensors.tmp, then renames it
        (out / "model.safetensors.tmp").unlink(missing_ok=True)
        raise write_error(out / "model.safetensors", e, sum(w.nbytes for w in checkpoint_weights(source).values())) from None
    record(out, ["model.safetensors"])
    if own_format is None:
        return None
    weights = load_weights(out)  # the whole model just written: save_pretrained takes it in memory
    return write_folders(
        out / "hf",
        lambda folder: own_format(
            model_cfg, weights, folder, data.vocab, chat_files=data.files, **({"label_names": labels} if labels else {})
        ),
        names=set(own_folders(model_cfg, own_format)),
        hint="free space (or fix the disk), then relaunch: the run writes hf/ again from its last checkpoint",
    )
