"""Metrics: `metrics.jsonl` plus the experiment tracker (wandb, tensorboard or none).

Only the main process writes files and talks to trackers; every record goes to both, so the tracker
shows exactly what `metrics.jsonl` holds.
"""

from __future__ import annotations

import json
import netrc
import os
import socket
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallel_train.checkpoint.disk import write_atomic, write_error
from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError, is_first_process

if TYPE_CHECKING:  # accelerate costs seconds to import; the trainer imports it when it needs it
    from accelerate import Accelerator


def wandb_server() -> tuple[str, int]:
    """Host and port of the wandb server (WANDB_BASE_URL, default https://api.wandb.ai)."""
    url = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(wandb_server()[0]) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_server_reachable(timeout_s: float = 5.0) -> bool:
    """One TCP connection attempt: wandb itself retries an unreachable server for minutes before failing."""
    try:
        socket.create_connection(wandb_server(), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def prepare_tracker_env(tracker: str, output_dir: Path, notice: Callable[[str], None]) -> str:
    """Set wandb's environment before it is imported. Returns a word for the banner."""
    if tracker != "wandb":
        return tracker
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    os.environ.setdefault("WANDB_CACHE_DIR", str(output_dir / "wandb" / "cache"))
    os.environ.setdefault("WANDB_SILENT", "true")
    if "WANDB_MODE" not in os.environ:
        # Only the main process talks to wandb; the others need no mode and make no connection.
        if not wandb_has_credentials():
            # No key: never prompt, never touch the network; `wandb sync` uploads the run later.
            os.environ["WANDB_MODE"] = "offline"
            notice("wandb: no credentials found (WANDB_API_KEY or `wandb login`), logging offline")
        elif is_first_process() and not wandb_server_reachable():
            os.environ["WANDB_MODE"] = "offline"
            host, port = wandb_server()
            notice(f"wandb: cannot reach {host}:{port}, logging offline (upload later with `wandb sync`)")
    return f"wandb ({os.environ.get('WANDB_MODE', 'online')})"


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists become strings (tensorboard's hparams take scalars only)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = str(value) if isinstance(value, (list, tuple)) else value
    return flat


def init_trackers(accelerator: Accelerator, tracker: str, config: dict[str, Any], output_dir: Path, run_id: str) -> None:
    """Start the tracker run on the main process (accelerate does nothing on the others)."""
    if tracker == "none":
        return
    if tracker == "wandb":
        # Same id + resume="allow": a resumed training run continues the same wandb run.
        init_kwargs = {"wandb": {"id": run_id, "resume": "allow", "name": output_dir.name, "dir": str(output_dir)}}
        try:
            accelerator.init_trackers(
                project_name=os.environ.get("WANDB_PROJECT", "parallel-train"), config=config, init_kwargs=init_kwargs
            )
        except Exception as e:  # wandb's errors (bad key, server down mid-start) have no common base class
            if not type(e).__module__.startswith("wandb"):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"wandb could not start a run ({first}); log locally with WANDB_MODE=offline, or use tracker=tensorboard or tracker=none"
            ) from None
    else:
        # Event files go to output_dir/tensorboard/, so `tensorboard --logdir runs` shows every run by name.
        accelerator.init_trackers(project_name="tensorboard", config=flat_config(config))


def finish_trackers(accelerator: Accelerator, tracker: str, output_dir: Path, run_id: str, say: Callable[[str], None]) -> None:
    """Close the tracker run and the process group (accelerator.end_training does both)."""
    accelerator.end_training()
    if tracker == "wandb" and accelerator.is_main_process and os.environ.get("WANDB_MODE") == "offline":
        runs = sorted((output_dir / "wandb").glob(f"offline-run-*-{run_id}"), key=lambda p: p.stat().st_mtime)
        if runs:
            say(f"wandb: offline run saved; upload it with: wandb sync {runs[-1]}")


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl and forwards it to the tracker."""

    def __init__(self, path: Path, accelerator: Accelerator, tracker: str):
        self.path, self.accelerator, self.tracker = path, accelerator, tracker

    def truncate_after(self, step: int, notice: Callable[[str], None]) -> None:
        """On resume: drop records of steps after the checkpoint (the killed run's lost work), and a half-written last
        line (a kill during an append) with a notice. Any other line that is not JSON is an error, before anything is
        written: the file is the run's history, not ours to guess at."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines, kept = text.splitlines(keepends=True), []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                if number == len(lines) and not line.endswith("\n"):  # every append ends with a newline: a torn one
                    notice(
                        f"notice: {self.path}: dropped its half-written last line ({len(line)} bytes, from a run killed while writing it)"
                    )
                    continue
                raise UserError(
                    f"{self.path}: line {number} is not a JSON record ({line.strip()[:60]!r}); remove or fix that line, then relaunch "
                    "(nothing was changed)"
                ) from None
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line.rstrip("\n") + "\n")
        write_atomic(self.path, "".join(kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        line = json_text(record) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as e:  # a full or failing disk: one line; a torn last line is dropped on resume
            raise write_error(self.path, e, len(line.encode())) from None
        if self.tracker != "none":
            values = {k: v for k, v in record.items() if k not in ("step", "kind") and isinstance(v, (int, float))}
            for k, v in record.items():  # a list of numbers (a MoE's expert_load per layer): one scalar each, k/0, k/1, ...
                if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                    values.update({f"{k}/{i}": x for i, x in enumerate(v)})
            # train/loss, train/lr, ... and val/loss: the metrics.jsonl keys grouped by kind.
            prefix = "val/" if record.get("kind") == "eval" else "train/"
            self.accelerator.log({prefix + k.removeprefix("val_"): v for k, v in values.items()}, step=record["step"])
