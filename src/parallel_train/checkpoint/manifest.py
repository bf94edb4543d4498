"""What makes a checkpoint trustworthy: a manifest of every file (size, sha256, the rank that wrote it), written
last, and the refusal to load any folder that holds something that could carry code.

Each rank hashes the files it wrote (the hashing is spread like the writing) and the main process writes
`manifest.json` once every rank's part is on disk; `verify` recomputes every hash before a resume takes the
checkpoint. The manifest is no signature (whoever can write the folder can rewrite it): it catches truncated,
missing, extra and changed files. Code is kept out by the formats: loading reads safetensors, JSON and YAML only,
and `refuse_code` stops at any file that is a pickle or a torch.save archive.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import socket
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import safe_open

from parallel_train import faults
from parallel_train.core.collectives import all_gather, from_rank0
from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

MANIFEST = "manifest.json"
SHARD_DIR = "shards"  # each rank's model and optimizer tensors (checkpoint/storage.py); nothing else goes there
# 1: whole model.safetensors + optimizer.safetensors (no format key); 2: per-rank shards. The "step" key came later
# within format 2: a reader of either kind goes on without it (the folder's name is then the step), so no new format.
FORMAT = 2


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # streams the file in chunks


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_of(folder: Path) -> list[str]:
    """Every file under `folder` as a relative POSIX path, the manifest excepted."""
    return sorted(n for n in (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if n != MANIFEST)


def record(folder: Path, name: str, rank: int) -> dict[str, Any]:
    """Flush one file this rank wrote to disk and describe it for the manifest."""
    path = folder / name
    fsync(path)
    return {"size": path.stat().st_size, "sha256": sha256(path), "rank": rank}


def write_manifest(folder: Path, records: dict[str, dict[str, Any]] | None = None, step: int | None = None) -> None:
    """The main process, once every rank's files are on disk: `records` from the ranks that wrote them; any other
    file (the JSON the main process wrote) is hashed here. Then the manifest, flushed with the folders. `step`: the
    checkpoint's step, which its folder's name only repeats (a folder can be copied or renamed; checkpoint/listing.py)."""
    files = {name: (records or {}).get(name) or record(folder, name, 0) for name in files_of(folder)}
    faults.in_seal(str(folder))  # test-only: a kill here must leave the old set of checkpoints (the rename comes after)
    head = {"format": FORMAT, **({"step": step} if step is not None else {})}
    (folder / MANIFEST).write_text(json_text({**head, "files": files}, indent=1))
    fsync(folder / MANIFEST)
    for sub in {(folder / n).parent for n in files}:
        fsync(sub)
    fsync(folder)


def manifest_step(folder: Path) -> int | None:
    """The step `folder`'s manifest records; None when it records none (checkpoints of earlier versions: the folder's
    name is then all there is) or cannot be read (verify says what is wrong with it)."""
    try:
        step = json.loads((folder / MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _outside(name: str) -> bool:
    path = PurePosixPath(name)
    return path.is_absolute() or ".." in path.parts or not path.parts


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it (in one process: every file)."""
    files, problem = check_structure(folder)
    return problem or check_contents(folder, files, list(files))


def check_structure(folder: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(the manifest's files, what is wrong with the folder's layout or None): the manifest parses, names only files
    inside the folder, every one exists at its size, nothing else is there. Cheap: no file is read but the manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return {}, "no manifest.json (incomplete or not a checkpoint)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
        sizes = {str(name): int(meta["size"]) for name, meta in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return {}, "manifest.json is unreadable"
    for name in sizes:
        if _outside(name):
            return files, f"manifest.json names {name!r}, which is not inside the checkpoint"
    problem = next(filter(None, (_size_problem(folder / name, size, name) for name, size in sizes.items())), None)
    if problem:
        return files, problem
    extra = [n for n in files_of(folder) if n not in sizes]
    if extra:
        return files, f"{extra[0]} is not in the manifest"
    if "trainer_state.json" not in sizes:
        return files, "trainer_state.json is not in the manifest"
    if "model.safetensors" not in sizes and not any(n.startswith(SHARD_DIR + "/") for n in sizes):
        return files, "the manifest lists no model weights"
    return files, None


def _size_problem(path: Path, size: int, name: str) -> str | None:
    if not path.is_file():
        return f"{name} is missing"
    if path.stat().st_size != size:
        return f"{name} has {path.stat().st_size} bytes, manifest says {size}"
    return None


def check_contents(folder: Path, files: dict[str, dict[str, Any]], names: list[str]) -> str | None:
    """What is wrong with the contents of `names` (their sha256; JSON and safetensors headers parse), or None."""
    for name in names:
        if sha256(folder / name) != files[name].get("sha256"):
            return f"{name} does not match its sha256 in the manifest"
    unreadable = next((n for n in names if not _parses(folder / n)), None)
    return f"{unreadable} is not a readable {Path(unreadable).suffix[1:]} file" if unreadable else None


# ---------------------------------------------------------------- verification spread over the ranks


def verifiers(files: dict[str, dict[str, Any]], world: int) -> dict[str, int]:
    """The rank that checks each file's contents: the rank that wrote it when the checkpoint was written by as many
    ranks as there are now; otherwise the files dealt out over the ranks that exist, largest first, by bytes."""
    writers = {name: meta.get("rank") for name, meta in files.items()}
    if writers and all(isinstance(r, int) and 0 <= r < world for r in writers.values()) and max(writers.values()) == world - 1:
        return writers
    load, out = [0] * world, {}
    for name in sorted(files, key=lambda n: (-int(files[n]["size"]), n)):
        out[name] = min(range(world), key=lambda r: (load[r], r))
        load[out[name]] += int(files[name]["size"]) + 1
    return out


def unseen(folder: Path, files: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(a file of the manifest this process cannot see at its size, why), or None. Only stats the files: cheap."""
    step = folder.name.rpartition("_")[2]
    if step.isdigit() and faults.hidden(int(step), listing=False):  # test-only: this rank's view is broken
        return next(iter(sorted(files))), "no such file (PARALLEL_TRAIN_FAULT=unreadable)"
    for name, meta in sorted(files.items()):
        try:
            size = (folder / name).stat().st_size
        except OSError as e:
            return name, e.strerror or type(e).__name__
        if size != int(meta["size"]):
            return name, f"{size} bytes, rank 0 sees {meta['size']}"
    return None


def verify_spread(folder: Path, rank: int, world: int, group=None) -> str | None:
    """`verify` with the reading spread over the ranks (a collective; the same answer on every rank): rank 0 checks
    the layout and refuses pickles, each rank hashes and parses its share of the files (`verifiers`), and every rank
    checks that it sees every file. Raises UserError, on every rank, when a rank cannot see a file rank 0 sees."""
    head: dict[str, Any] | None = None
    if rank == 0:
        try:
            refuse_code(folder)
            files, problem = check_structure(folder)
            head = {"files": files, "problem": problem}
        except UserError as e:
            head = {"error": str(e)}
        except OSError as e:
            head = {"files": {}, "problem": f"cannot be read ({e.strerror})"}
    head = from_rank0(head, group)
    if "error" in head:
        raise UserError(head["error"])
    if head["problem"]:
        return head["problem"]
    files = head["files"]
    mine = [name for name, r in verifiers(files, world).items() if r == rank]
    missing = unseen(folder, files)
    problem = None if missing else check_contents(folder, files, mine)
    results = all_gather((socket.gethostname(), missing, problem), group)
    for r, (host, missing, _) in enumerate(results):
        if missing:
            raise UserError(
                f"rank {r} (host {host}) cannot read {folder / missing[0]} ({missing[1]}), which rank 0 sees: every process "
                "must see output_dir as rank 0 does (one shared file system, up to date); fix the mount, then relaunch"
            )
    return next((problem for _, _, problem in results if problem), None)


def _parses(path: Path) -> bool:
    """JSON files parse and safetensors headers parse (a file that matches its hash may still have been planted
    with the manifest rewritten to match): such a checkpoint is skipped like a corrupt one, before anything reads it."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                pass
        return True
    except Exception:  # json's, unicode's or safetensors' own errors: all mean "not this format"
        return False


# Formats that can carry code (pickle, and torch.save's zip of pickles). This template writes none of them.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz", ".zip", ".joblib", ".metadata", ".distcp")


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
    for path in sorted(folder.rglob("*")):
        why = _code_carrier(path) if path.is_file() else None
        if why:
            raise UserError(
                f"checkpoint {folder}: {why}; refusing to load it (this template writes only safetensors, "
                "JSON and YAML and never unpickles). Remove the file or resume from a checkpoint you trust"
            )
