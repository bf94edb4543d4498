"""Guards that end a run cleanly instead of losing work or continuing from a wrong state.

- Stop signals: SIGTERM (SLURM preemption, torchrun shutting down), SIGUSR1 (SLURM's `--signal=USR1@T`
  warning) and SIGINT (Ctrl-C) do not kill the process; they ask the loop to stop. The loop stops at a
  step every rank agrees on, writes a checkpoint there (a collective) and exits 0 with the command to go on.
  A second Ctrl-C stops at once (without a checkpoint).
- Non-finite loss or gradients: by default the run stops with an error naming the first bad step; with
  `train.max_skipped_steps=N` such steps are skipped (no optimizer update), N at most. Either way every rank
  takes the same decision, and no checkpoint (or final model) with non-finite weights is ever written.
- A collective that fails (a peer died, or hung longer than parallel.timeout_s) ends this process with one
  line and exit code 1 instead of a C++ traceback or a hang, so an elastic launcher can restart the job
  (errors.py words it from the step recorded here in PROGRESS).

Agreement: ranks compare notes with one all-reduce of two integers ("a stop signal arrived", "first
non-finite step") every AGREE_EVERY steps and on log, checkpoint and final steps. Not every step: on GPUs
reading the result is a host-device sync that would stall the pipelined launch of kernels, and on CPU the
extra gloo round trip (a barrier between ranks) cost 4% of 2-process throughput (docs/BENCHMARKS.md). A
signal is then honoured within that many steps (well inside SLURM's and torchrun's grace periods of 30 s or
more), and the first non-finite step in between is kept on the device (a running minimum, never read), so it is
still named. The agreement itself is one collective on the device and one copy back: the signal goes in as a fill
on the device, not as a host tensor copied over.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import torch

from parallel_train.core.collectives import all_reduce_small
from parallel_train.errors import PROGRESS, UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
AGREE_EVERY = 16
NO_BAD_STEP = 2**62  # "no non-finite step seen" in the agreement's min-reduction


class StopSignals:
    """Turns SIGTERM/SIGUSR1/SIGINT into a request to stop at the next agreed step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._interrupts = 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            # Ctrl-C reaches every process of the terminal's group, and torchrun then sends SIGTERM on top:
            # only a second SIGINT means "stop now, no checkpoint".
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        if self.received is None:
            self.received = signum

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None


class RunGuard:
    """The trainer's guard: call begin_step/end_step around every step; the engine calls update_allowed."""

    def __init__(self, accelerator, max_skipped: int, timeout_s: int, skipped_so_far: int = 0):
        self.accelerator, self.device = accelerator, accelerator.device
        self.max_skipped, self.skipped = max_skipped, skipped_so_far
        self.signals = StopSignals()
        self.step = 0
        self._first_bad: torch.Tensor | None = None  # the first non-finite step since the last agreement (device)
        self._noted = 0  # the last step whose flag is in _first_bad
        PROGRESS.timeout_s, PROGRESS.rank = timeout_s, accelerator.process_index

    # ---- per step

    def begin_step(self, step: int) -> None:
        self.step = PROGRESS.step = step

    def update_allowed(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Called by the engine between backward and optimizer.step(): False means skip this update."""
        bad = ~torch.isfinite(loss.detach())
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.detach())
        if self.max_skipped == 0:
            self._note(self.step, bad)  # read at the next agreement: no sync here
            return True
        # Skipping needs the verdict before the update: one all-reduce and host sync per step (the price
        # of train.max_skipped_steps > 0, documented there). MAX: if any rank saw it, every rank skips.
        if not int(all_reduce_small(bad.to(torch.int32).reshape(1), torch.distributed.ReduceOp.MAX, self.device).item()):
            return True
        self.skipped += 1
        if self.skipped > self.max_skipped:
            raise UserError(
                f"non-finite loss or gradients at step {self.step}: {self.skipped} steps skipped, more than "
                f"train.max_skipped_steps={self.max_skipped}; lower train.learning_rate or check the data"
            )
        if self.accelerator.is_main_process:
            print(
                f"warning: non-finite loss or gradients at step {self.step}: update skipped ({self.skipped} of at most {self.max_skipped})",
                flush=True,
            )
        return False

    def _note(self, step: int, bad: torch.Tensor) -> None:
        """Keep the earliest non-finite step on the device: where(bad, step, none), a running minimum."""
        here = torch.where(bad.reshape(()), step, NO_BAD_STEP)  # Python numbers: kernel arguments, no copy
        self._first_bad = here if self._first_bad is None else torch.minimum(self._first_bad, here)
        self._noted = step

    def end_step(self, step: int, loss: torch.Tensor, force: bool = False) -> str | None:
        """Agree with the other ranks (every AGREE_EVERY steps, or when forced): raises on a non-finite step,
        returns the stop signal's name when any rank received one, else None. Every rank calls it every step."""
        if self.max_skipped == 0 and self._noted != step:
            self._note(step, ~torch.isfinite(loss.detach()))  # an engine that does not call update_allowed
        if not force and step % AGREE_EVERY:
            return None
        device = self._first_bad.device if self._first_bad is not None else self.device
        first_bad = self._first_bad if self._first_bad is not None else torch.full((), NO_BAD_STEP, device=device)
        self._first_bad = None
        got_signal = torch.full((), self.signals.received or 0, device=device)  # its number: every rank can name it
        # One all-reduce and one copy back: MAX of (signal, -first_bad) = (a signal any rank got, -(earliest bad step)).
        agreed = all_reduce_small(
            torch.stack([got_signal, -first_bad]).to(torch.int64), torch.distributed.ReduceOp.MAX, self.device
        ).tolist()
        if -agreed[1] != NO_BAD_STEP:
            raise UserError(
                f"non-finite loss or gradients at step {-agreed[1]} (all ranks stopped at step {step}; no checkpoint "
                "was written after it); lower train.learning_rate, check the data, or set train.max_skipped_steps=N "
                "to skip such steps"
            )
        if agreed[0]:
            return self.signals.name or signal.Signals(agreed[0]).name
        return None


def stop_message(signal_name: str, step: int, max_steps: int, saved: Path) -> str:
    """What a preempted run prints last: where its work is and the command that continues it."""
    args = [a for a in sys.argv[1:] if not a.startswith("resume=")]
    command = " ".join(shlex.quote(a) for a in ["train.py", *args, "resume=auto"])
    return (
        f"[parallel_train] {signal_name}: stopped at step {step} of {max_steps} and saved {saved}. "
        f"To continue, relaunch the same way (python / accelerate launch / torchrun) with: {command}"
    )
