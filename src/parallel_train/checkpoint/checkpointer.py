"""Atomic, verifiable, code-free checkpoints that every rank writes its own part of, optionally in the background.

Layout of `output_dir/checkpoints/step_0000500/`:
    shards/rank00000-000.safetensors, ...   each rank's part of the model and optimizer tensors (checkpoint/storage.py):
                             keys `model/<name>` and `optimizer/<name>/<state>` (checkpoint/named_state.py); FSDP2/TP shards and
                             pipeline stages by the rank that holds them, a replicated tensor by one rank only
    optimizer.json           optimizer hyperparameters per param group (by parameter name), and non-tensor state
    rng_rank{R}.safetensors  every rank's torch CPU (and CUDA) generator state, for exact dropout on resume
    trainer_state.json       step, LR scheduler, best val loss, tracker run id, world size
    config.yaml, vocab.json  the resolved config and the tokenizer of the run (tokenizer.json for BPE/Hugging Face)
    manifest.json            size, sha256 and writing rank of every file above; written last (checkpoint/manifest.py)

Nothing is gathered whole on one rank: each rank writes and hashes its own files, the main process writes the
small JSON files and, once every rank's part is on disk, the manifest. A checkpoint is written into
`.tmp-step_*` and renamed after the manifest: a kill at any moment leaves the old set of checkpoints or the new
one, never a half-written `step_*`. A write that fails on any rank (a full disk) stops every rank with the same
line, after the temporary folder is removed (SaveFailure). Pruning keeps the newest `checkpoint.keep` by step
up to the step just written, and the checkpoint the run resumed from until a newer one has verified (listing and
pruning by the manifest's step: checkpoint/listing.py).
Loading never unpickles: safetensors, JSON and YAML only. Checkpoints of earlier versions (whole
`model.safetensors` + `optimizer.safetensors`) still load. Which checkpoint a run resumes from: run/resume.py.

With `checkpoint.async=true` a save copies this rank's tensors (to host memory; pinned when they live on a GPU) and
training goes on while a background thread writes them and seals the checkpoint; the next save, and the end of
the run, first wait for it. A kill during the background write leaves the previous checkpoint as the resume point.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from parallel_train import faults
from parallel_train.checkpoint import storage
from parallel_train.checkpoint.disk import as_os_error, free_bytes, human
from parallel_train.checkpoint.listing import best_checkpoint, checkpoint_name, checkpoint_step, list_checkpoints, prune  # noqa: F401  (scripts and tests)
from parallel_train.checkpoint.manifest import MANIFEST, SHARD_DIR, fsync, record, refuse_code, verify, verify_spread, write_manifest  # noqa: F401  (checkpoint.verify: scripts and tests)
from parallel_train.checkpoint.named_state import RankState, load_into, merge_meta, rank_tensors, templates
from parallel_train.checkpoint.train_state import TrainingState
from parallel_train.core.collectives import all_gather, all_reduce_small, gather_to_rank0
from parallel_train.core.collectives import rank as this_rank
from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

# ---------------------------------------------------------------- save


def check_finite_weights(engine, step: int) -> None:
    """Refuse to write weights that hold NaN/inf. A collective: every rank checks its own parameters."""
    bad = torch.zeros((), dtype=torch.int64)
    # The optimizer holds exactly this rank's parameters under every engine (whole model, shard or stage).
    for p in (q for group in engine.optimizer.param_groups for q in group["params"]):
        local = (p.to_local() if hasattr(p, "to_local") else p).detach()  # a DTensor's shard
        # A sum is finite only if every element is (NaN and inf propagate), and summing is about 10x faster than
        # isfinite().all() on the CPU (0.06 s against 0.6 s for 98M parameters, part of every checkpoint save). A
        # non-finite sum may also be an overflow of huge finite weights: only then is every element looked at.
        if not bool(torch.isfinite(local.sum())) and not bool(torch.isfinite(local).all()):
            bad.fill_(1)
            break
    if all_reduce_small(bad, torch.distributed.ReduceOp.MAX, engine.accelerator.device).item():
        raise UserError(
            f"the model weights are non-finite (NaN or inf) at step {step}: not writing them; "
            "lower train.learning_rate or check the data, then resume=auto from the last checkpoint"
        )


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def attempt(write, name: str | None = None) -> dict[str, Any] | None:
    """Run `write`; None, or what failed (a full or failing disk) as SaveFailure.agree takes it."""
    try:
        write()
    except (OSError, SafetensorError) as e:
        return describe_failure(e, name)
    return None


def describe_failure(error: BaseException, name: str | None = None) -> dict[str, Any] | None:
    """{"rank", "file", "error"} for a failed write (a CheckpointException: its first failing rank's), or None when
    the error is not about writing (a bug: it is raised as it is)."""
    rank = this_rank()
    if isinstance(error, CheckpointException):
        rank, (error, _) = min(error.failures.items(), key=lambda item: item[0])
    os_error = as_os_error(error, name)
    if os_error is None:
        return None
    path = Path(str(os_error.filename or name)) if (os_error.filename or name) else None
    shown = "a file" if path is None else f"{SHARD_DIR}/{path.name}" if path.parent.name == SHARD_DIR else path.name
    return {"rank": rank, "file": shown, "error": os_error.strerror or type(os_error).__name__}


class SaveFailure:
    """Where one save's ranks agree that it failed: every rank calls `agree` at the same points; if any rank failed,
    rank 0 removes the temporary folder and every rank raises the same one-line UserError (file, bytes needed,
    space free), so no rank waits in a collective for one that stopped. The earlier checkpoints are untouched."""

    def __init__(self, step: int, tmp: Path, root: Path, needed: int, group):
        self.step, self.tmp, self.root, self.needed, self.group = step, tmp, root, needed, group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1

    def agree(self, problem: dict[str, Any] | None) -> None:
        reports = all_gather((problem, self.needed, free_bytes(self.root) if this_rank() == 0 else None), self.group)
        failed = [p for p, _, _ in reports if p]
        if not failed:
            return
        if this_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        first, needed, free = failed[0], sum(n for _, n, _ in reports), reports[0][2]
        raise UserError(
            f"checkpoint {checkpoint_name(self.step)}: writing {first['file']} on rank {first['rank']} failed ({first['error']}): "
            f"the checkpoint needs up to {human(needed)}, {human(free) if free is not None else 'an unknown amount'} free in "
            f"{self.root}; removed {self.tmp.name}, the earlier checkpoints are intact. Free space (or fix the disk), then "
            "relaunch with resume=auto"
        )


def rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states (dropout must continue exactly where it stopped)."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


class Checkpointer:
    """Writes one run's checkpoints: synchronously, or with `background=True` (checkpoint.async) in a thread.

    Every rank calls `save` at the same step, and `finish` before the run's final outputs and before it exits.
    `blocking_s` adds up the time the training loop spent in `save` (the whole write, or with a background write the
    copy and any wait for the previous one); `drain_s` the final wait for the last background write.
    """

    def __init__(
        self, root: Path, keep: int, keep_best: bool = False, protect: Path | None = None, background: bool = False, timeout_s: int = 1800
    ):
        self.root, self.keep, self.keep_best, self.protect, self.background = root, keep, keep_best, protect, background
        self.rank = this_rank()
        # Checkpoint collectives run on their own gloo group: a background write talks to the other ranks while
        # training does, and the two must never interleave on one group (gloo also gathers objects on the CPU
        # where NCCL could not). Created here, by every rank at the same point: creating a group is a collective.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if dist.is_initialized() else None
        self.pending: Future | None = None
        self.stager = None
        self.blocking_s = self.drain_s = 0.0

    def save(self, engine, state: TrainingState, scheduler, precision, config_yaml: str, tokenizer_files: dict[str, str]) -> Path:
        """Checkpoint the step `state` is at: the engine's state, the trainer's, the config and the tokenizer
        (`tokenizer_files`: vocab.json or tokenizer.json, data/tokenizers.py). A collective: every rank calls it."""
        started = time.perf_counter()
        self.wait()  # the previous background write first: its collectives and these must not interleave
        check_finite_weights(engine, state.step)  # never a checkpoint with NaN/inf weights (all ranks agree)
        trainer_state = dict(state.to_dict(), scheduler=scheduler.state_dict())
        if precision.state_dict() is not None:  # fp16's loss scale (plain numbers)
            trainer_state["grad_scaler"] = precision.state_dict()
        files = {"trainer_state.json": json_text(trainer_state, indent=1), "config.yaml": config_yaml, **tokenizer_files}
        final = self.write(state.step, engine.rank_state(), files)
        self.blocking_s += time.perf_counter() - started
        return final

    def write(self, step: int, rank: RankState, files: dict[str, str]) -> Path:
        """Checkpoint `step` of `rank`'s state plus `files` (name -> text, written by the main process). Returns
        when the checkpoint is in place, or with `background` once its tensors are copied. A collective."""
        self.wait()  # one checkpoint in flight at a time
        final, tmp = self.root / checkpoint_name(step), self.root / f".tmp-{checkpoint_name(step)}"
        tensors, meta = rank_tensors(rank)
        needed = sum(t.numel() * t.element_size() for t in tensors.values()) + sum(len(t.encode()) for t in files.values())
        self.failed = SaveFailure(step, tmp, self.root, needed, self.group)
        self.failed.agree(attempt(lambda: _fresh_folder(tmp), tmp.name) if self.rank == 0 else None)  # every rank after rank 0's mkdir
        parts = gather_to_rank0(meta, self.group)  # a pipeline rank names only its own parameters
        rng_file = f"rng_rank{self.rank}.safetensors"
        problem = attempt(lambda: save_file(rng_state(), str(tmp / rng_file)), rng_file)
        if self.rank == 0 and problem is None:
            texts = {**files, "optimizer.json": json_text(merge_meta(parts), indent=1)}
            problem = next(
                filter(None, (attempt(lambda n=n, t=t: (tmp / n).write_text(t, encoding="utf-8"), n) for n, t in texts.items())), None
            )
        self.failed.agree(problem)
        if not self.background:
            self._write_and_seal(step, tmp, final, tensors, [rng_file])
            return final
        if self.stager is None:
            # Host buffers kept from save to save (allocating them again costs 3-4x the copy, measured on CPU), pinned
            # when the state lives on a GPU; the copy itself in this thread, before training goes on.
            gpu = any(t.device.type == "cuda" for t in tensors.values())
            self.stager = DefaultStager(
                StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu)
            )
        staged = self.stager.stage(tensors)  # a copy: training may change the live tensors from here on
        self.pending = Future()
        threading.Thread(target=self._background, args=(self.pending, step, tmp, final, staged, [rng_file]), daemon=True).start()
        return final

    def _background(self, future: Future, *args) -> None:
        # A daemon thread: a run that stops on an error does not wait for it (its checkpoint stays a .tmp-* folder).
        try:
            self._write_and_seal(*args)
            future.set_result(None)
        except BaseException as e:  # handed to the training thread at its next wait()
            future.set_exception(e)

    def _write_and_seal(self, step: int, tmp: Path, final: Path, tensors: dict[str, torch.Tensor], own: list[str]) -> None:
        """Every rank writes its tensors and hashes its files; rank 0 writes the manifest and renames; then the
        older checkpoints are pruned. A collective: a write that fails on any rank stops every rank (SaveFailure)."""
        written, problem = [], None
        try:  # DCP hands a failure on any rank to every rank, as a CheckpointException
            written = storage.write(tmp / SHARD_DIR, tensors, self.group)  # returns once every rank's part is on disk
        except (CheckpointException, OSError, SafetensorError) as e:
            problem = describe_failure(e)
            if problem is None:
                raise
        self.failed.agree(problem)
        faults.in_save(step)  # test-only: a kill here must leave the previous checkpoint the resume point
        records: dict[str, Any] = {}
        problem = attempt(lambda: records.update({n: record(tmp, n, self.rank) for n in [f"{SHARD_DIR}/{w}" for w in written] + own}))
        self.failed.agree(problem)
        merged = {name: rec for part in gather_to_rank0(records, self.group) for name, rec in part.items()}
        self.failed.agree(attempt(lambda: self._seal(step, tmp, final, merged), MANIFEST) if self.rank == 0 else None)
        if self.protect is not None and verify_spread(final, self.rank, self.failed.world, self.group) is None:
            self.protect = None  # a newer checkpoint verified: the one this run resumed from may go now
        if self.rank == 0:
            prune(self.root, self.keep, protect=self.protect, keep_best=self.keep_best, upto=step)
        self._barrier()

    def _seal(self, step: int, tmp: Path, final: Path, records: dict[str, Any]) -> None:
        """Rank 0: the manifest (with the step: the folder's name only repeats it), then the rename that makes the
        checkpoint exist."""
        write_manifest(tmp, records, step)
        if final.exists():  # the same step saved again (e.g. a resumed run that ends where it started)
            old = self.root / f".tmp-old-{final.name}"  # moved aside, not deleted, until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync(self.root)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def wait(self) -> None:
        """Until the background write (if any) is on disk and sealed; raises what it raised."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def finish(self) -> None:
        """Wait for the last background write (before the run's final outputs and before exiting), then free the
        host copy of the state."""
        started = time.perf_counter()
        self.wait()
        self.drain_s += time.perf_counter() - started
        if self.stager is not None:
            self.stager.close()
            self.stager = None


# ---------------------------------------------------------------- load


def topology_notice(saved: TrainingState, world: int, global_batch: int) -> str | None:
    """One line when a run resumes on another number of processes or another global batch.

    Model and optimizer state are keyed by name, so they load into any topology. The data order depends only
    on (seed, global batch, step) (data/batch_sampler.py): with the same global batch the resumed run reads exactly the
    samples the old one would have; with another, step k reads the k-th slice of the new size from the same
    shuffled stream, so a few samples are skipped or seen twice at the switch.
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


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"resume: {path} is not readable JSON ({str(e).splitlines()[0][:120]}); resume from another checkpoint") from None


def _model_names(rank: RankState) -> set[str]:
    """The weights of the whole model: every rank's (a pipeline rank holds a few). A collective."""
    return {name for part in all_gather(sorted(rank.model)) for name in part}


def load_rank_state(folder: Path, rank: RankState) -> None:
    """Load `folder`'s model and optimizer state into this rank's part (any topology, by name). A collective."""
    meta = read_json(folder / "optimizer.json")
    names = _model_names(rank)
    if not (folder / SHARD_DIR).is_dir():  # the format before each rank wrote its own part (dropped: reliability.md)
        raise UserError(
            f"resume: {folder} was written by an earlier version of this template (one whole model.safetensors, no "
            f"{SHARD_DIR}/), which this version no longer reads; continue it with the version that wrote it"
        )
    saved = storage.saved_tensors(folder / SHARD_DIR)  # verify() has read every header once
    tensors = templates(rank, saved, names)
    storage.read(folder / SHARD_DIR, tensors)
    load_into(rank, tensors, meta)


def load(folder: Path, engine, scheduler, precision) -> TrainingState:
    """Restore model, optimizer, scheduler and this rank's RNG from `folder`; return the training state it saved."""
    accelerator = engine.accelerator
    state = read_json(folder / "trainer_state.json")
    try:
        load_rank_state(folder, engine.rank_state())
    except (UserError, RuntimeError, KeyError, ValueError) as e:  # a missing weight, another shape, load_state_dict's errors
        if isinstance(e, UserError) and str(e).startswith("resume:"):
            raise
        details = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = (details[1] if len(details) > 1 and details[0].startswith("Error(s) in loading") else (details or [repr(e)])[0])[:200]
        raise UserError(
            f"resume: {folder} does not fit this model/optimizer ({detail}); resume with the config it was "
            f"written with ({folder / 'config.yaml'}) or choose a new output_dir"
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    precision.load_state_dict(state.get("grad_scaler"))
    rng_file = folder / f"rng_rank{accelerator.process_index}.safetensors"
    if state.get("world_size") == accelerator.num_processes and rng_file.exists():
        rng = load_tensors(rng_file)
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda_"))]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
    return TrainingState.from_dict(state)
