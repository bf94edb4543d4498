"""Atomic, verifiable, code-free checkpoints.

Layout of `output_dir/checkpoints/step_0000500/`:
    model.safetensors        full model, canonical parameter names (the unwrapped, unsplit model's)
    optimizer.safetensors    optimizer state keyed by parameter name (e.g. `blocks.0.attn.qkv.weight/exp_avg`)
    optimizer.json           optimizer hyperparameters per param group, and non-tensor state
    rng_rank{R}.safetensors  every rank's torch CPU (and CUDA) generator state, for exact dropout on resume
    trainer_state.json       step, LR scheduler, best val loss, tracker run id, world size
    config.yaml, vocab.json  the resolved config and the tokenizer of the run (tokenizer.json for BPE/Hugging Face)
    manifest.json            size and sha256 of every file above; written last

A checkpoint is written into `.tmp-step_*`, flushed, then renamed: a kill at any moment leaves either the
old set of checkpoints or the new one, never a half-written `step_*`. Loading never unpickles code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickletools
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from parallel_train import faults
from parallel_train.dtensor_state import is_sharded, shard_like, to_full, upgrade_names
from parallel_train.errors import UserError
from parallel_train.guards import check_finite_weights
from parallel_train.train_state import TrainingState

PREFIX = "step_"
MANIFEST = "manifest.json"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    for p in files:
        _fsync(p)
    (folder / MANIFEST).write_text(json.dumps({"files": manifest}, indent=1))
    _fsync(folder / MANIFEST)
    _fsync(folder)


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (incomplete or not a checkpoint)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return "manifest.json is unreadable"
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(p) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    for needed in ("model.safetensors", "trainer_state.json"):
        if needed not in files:
            return f"{needed} is not in the manifest"
    return None


# Formats that can carry code (pickle, and torch.save's zip of pickles). This template writes none of them.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz", ".zip", ".joblib")


def _safetensors_header_ok(path: Path) -> bool:
    """A safetensors file starts with the 8-byte length of a JSON header that fits in the file."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8 and head[8:] == b"{"


def _parses_as_pickle(path: Path) -> bool:
    """True if the file is a complete pickle. pickletools only decodes opcodes: nothing is executed."""
    try:
        with open(path, "rb") as f:
            for _ in pickletools.genops(f):
                pass
        return True
    except Exception:
        return False


def _code_carrier(path: Path) -> str | None:
    """Why `path` could execute code when unpickled, else None."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return f"{path.name} is a pickle-type file"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        return f"{path.name} is a zip archive (torch.save format, which holds pickles)"
    # Pickles of protocol 2+ start with 0x80; a real safetensors file may too (its header length), so
    # only a file that is not a valid safetensors file and decodes as a whole pickle counts.
    if head[:1] == b"\x80" and not (path.suffix == ".safetensors" and _safetensors_header_ok(path)) and _parses_as_pickle(path):
        return f"{path.name} is a pickle"
    return None


def refuse_code(folder: Path) -> None:
    """Raise if any file in the checkpoint could carry code: loading never unpickles, and a planted pickle
    means the folder was tampered with, so this is an error, not a warning."""
    for path in sorted(folder.iterdir()):
        why = _code_carrier(path) if path.is_file() else None
        if why:
            raise UserError(
                f"checkpoint {folder}: {why}; refusing to load it (this template writes only safetensors, "
                "JSON and YAML and never unpickles). Remove the file or resume from a checkpoint you trust"
            )


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints (renamed from .tmp-*), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def find_latest_valid(root: Path, warn) -> Path | None:
    """Newest checkpoint that passes its manifest; each one skipped is named in a warning."""
    for folder in reversed(list_checkpoints(root)):
        refuse_code(folder)
        problem = verify(folder)
        if problem is None:
            return folder
        warn(f"skipping checkpoint {folder}: {problem}")
    return None


def resolve_resume(resume: str, root: Path, warn) -> Path | None:
    """`auto` -> newest valid checkpoint or None; `none` -> None; a path -> that checkpoint, verified."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest_valid(root, warn)
    path = Path(resume)
    if not path.exists():
        raise UserError(f"resume: no such checkpoint {resume!r}; use resume=auto, resume=none or a checkpoints/step_* folder")
    if path.is_dir() and not (path / MANIFEST).exists() and list_checkpoints(path / "checkpoints"):
        path = find_latest_valid(path / "checkpoints", warn) or path  # a run folder: take its newest
    if path.is_dir():
        refuse_code(path)
    problem = verify(path) if path.is_dir() else "not a folder"
    if problem:
        raise UserError(f"resume: {resume!r} is not a valid checkpoint ({problem})")
    return path


# ---------------------------------------------------------------- optimizer state by parameter name


def optimizer_state_by_name(model, optimizer, keep: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's state keyed by parameter names instead of positions.

    Positions depend on how the model was cut (a pipeline stage holds a few parameters); names do not,
    so a checkpoint from any topology loads into any other. Sharded (FSDP2 DTensor) states are gathered
    into whole tensors (a collective: every rank calls this) and kept where `keep` is true (default: on
    global rank 0 only, which writes them; a pipeline stage keeps them on its own first rank).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    keeper = keep if keep is not None else (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    if "state" not in sd:  # DeepSpeed ZeRO keeps flat partitions, not one state per parameter: nothing to name
        return {}, {"param_groups": [], "scalars": {}, "missing": "DeepSpeed ZeRO optimizer state (partitioned) is not saved"}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, param_state in sd["state"].items():
        name = names[id(params[idx])]
        for key, value in param_state.items():
            if is_sharded(value):  # gather on every rank (a collective); only the writer keeps it, to spare host RAM
                full = to_full(value)
                if keeper:
                    tensors[f"{name}/{key}"] = full.detach().contiguous().cpu()
            elif torch.is_tensor(value):
                tensors[f"{name}/{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}/{key}"] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_by_name(model, optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Inverse of optimizer_state_by_name, for whichever parameters this optimizer holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    tensors = upgrade_names(model, tensors)  # checkpoints from before a parameter rename (e.g. GPT's fused qkv)
    meta = {**meta, "scalars": upgrade_names(model, meta.get("scalars", {}))}
    if "missing" in meta or "state" not in sd:  # saved under DeepSpeed ZeRO, or loading into it: the optimizer starts fresh
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx, p in enumerate(params):
        prefix = names[id(p)] + "/"
        entry = {k[len(prefix) :]: shard_like(v, p) for k, v in tensors.items() if k.startswith(prefix)}
        entry.update({k[len(prefix) :]: v for k, v in meta["scalars"].items() if k.startswith(prefix)})
        if entry:
            state[idx] = entry
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(sd["param_groups"]):
        raise UserError(
            f"resume: the checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(sd['param_groups'])}; "
            "was it written with another train.optimizer?"
        )
    groups = []
    for saved, current in zip(saved_groups, sd["param_groups"], strict=True):
        hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"}
        groups.append({**current, **hyper, "params": current["params"]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------- save


def save(
    engine,
    root: Path,
    step: int,
    scheduler,
    state: TrainingState,
    config_yaml: str,
    tokenizer_files: dict[str, str],
    keep: int,
    protect: Path | None = None,
    keep_best: bool = False,
) -> Path:
    """Write checkpoint `step` (the step `state` is at) atomically. A collective: every rank must call it."""
    accelerator = engine.accelerator
    check_finite_weights(engine, step)  # never a checkpoint with NaN/inf weights (all ranks agree)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()

    # Every rank: its own generator states (dropout must continue exactly where it stopped).
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / f"rng_rank{accelerator.process_index}.safetensors"))

    # Collectives (the state may be sharded or split over ranks): every rank calls them.
    model_state = engine.full_state_dict()
    opt_tensors, opt_meta = engine.optimizer_state()
    if accelerator.is_main_process:
        save_file(model_state, str(tmp / "model.safetensors"))
        faults.in_save(step)  # test-only: a kill here must leave the previous checkpoint valid
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta, indent=1))
        full_state = dict(state.to_dict(), scheduler=scheduler.state_dict())
        if getattr(accelerator, "scaler", None) is not None:  # fp16's loss scale (plain numbers)
            full_state["grad_scaler"] = accelerator.scaler.state_dict()
        (tmp / "trainer_state.json").write_text(json.dumps(full_state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        for name, text in tokenizer_files.items():  # vocab.json or tokenizer.json (tokenization.py)
            (tmp / name).write_text(text, encoding="utf-8")
    accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        write_manifest(tmp)
        if final.exists():  # the same step saved again (e.g. a resumed run that ends where it started)
            old = root / f".tmp-old-{checkpoint_name(step)}"  # moved aside, not deleted, until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(root)
        prune(root, keep, protect=protect, keep_best=keep_best)
    accelerator.wait_for_everyone()
    return final


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


def prune(root: Path, keep: int, protect: Path | None = None, keep_best: bool = False) -> None:
    """Keep the newest `keep` checkpoints, `protect` (the one this run resumed from), and with `keep_best`
    the one with the lowest val loss."""
    spared = {p.resolve() for p in (protect, best_checkpoint(root) if keep_best else None) if p is not None}
    for old in list_checkpoints(root)[:-keep]:
        if old.resolve() in spared:
            continue
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------- load


def topology_notice(saved: TrainingState, world: int, global_batch: int) -> str | None:
    """One line when a run resumes on another number of processes or another global batch.

    Model and optimizer state are whole tensors keyed by name, so they load into any topology. The data
    order depends only on (seed, global batch, step) (data.py): with the same global batch the resumed run
    reads exactly the samples the old one would have; with another, step k reads the k-th slice of the new
    size from the same shuffled stream, so a few samples are skipped or seen twice at the switch.
    """
    old_world, old_batch = saved.world_size, saved.global_batch
    if old_world == world and old_batch in (None, global_batch):
        return None
    line = (
        f"notice: the checkpoint was written by {old_world} processes, this run has {world}: model and optimizer "
        "state carry over; per-rank dropout RNG restarts from the seed"
        if old_world != world
        else "notice: the global batch changed since the checkpoint"
    )
    if old_batch is not None and old_batch != global_batch:
        return line + (
            f"; the global batch was {old_batch} samples and is now {global_batch}, so the data order "
            "does not continue exactly (keep batch_size x processes x accumulation the same for that)"
        )
    return line + "; the global batch is unchanged, so the data order continues exactly"


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors through safetensors only (it parses a header and raw bytes: no code can run)."""
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError for anything malformed
        raise UserError(
            f"resume: {path} is not a readable safetensors file ({str(e).splitlines()[0][:120]}); resume from another checkpoint"
        ) from None


def load(folder: Path, engine, scheduler) -> TrainingState:
    """Restore model, optimizer, scheduler and this rank's RNG from `folder`; return the training state it saved."""
    accelerator = engine.accelerator
    state = json.loads((folder / "trainer_state.json").read_text())
    try:
        engine.load(
            load_tensors(folder / "model.safetensors"),
            load_tensors(folder / "optimizer.safetensors"),
            json.loads((folder / "optimizer.json").read_text()),
        )
    except (RuntimeError, KeyError, ValueError) as e:  # load_state_dict: missing keys, shape mismatches
        details = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = (details[1] if len(details) > 1 and details[0].startswith("Error(s) in loading") else (details or [repr(e)])[0])[:200]
        raise UserError(
            f"resume: {folder} does not fit this model/optimizer ({detail}); resume with the config it was "
            f"written with ({folder / 'config.yaml'}) or choose a new output_dir"
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    if state.get("grad_scaler") and getattr(accelerator, "scaler", None) is not None:
        accelerator.scaler.load_state_dict(state["grad_scaler"])
    rng_file = folder / f"rng_rank{accelerator.process_index}.safetensors"
    if state.get("world_size") == accelerator.num_processes and rng_file.exists():
        rng = load_tensors(rng_file)
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda_"))]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
    return TrainingState.from_dict(state)
