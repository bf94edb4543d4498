"""The training state beside the tensors: what a checkpoint's trainer_state.json holds (plain JSON).

One typed object, so what a checkpoint stores is written down in one place: the trainer updates it as the
run goes, checkpoint/checkpointer.py writes it (with the LR scheduler's and the loss scaler's state) and reads it back.
Checkpoints written before this class existed hold the same keys and load into it.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_run_id() -> str:
    """The tracker run's id: a resumed run keeps it, so wandb continues the same run."""
    return uuid.uuid4().hex[:12]


@dataclass
class TrainingState:
    step: int = 0  # optimizer steps done
    run_id: str = field(default_factory=new_run_id)
    world_size: int | None = None  # processes of the run that wrote the checkpoint
    global_batch: int | None = None  # samples per optimizer step: with the seed, it fixes the data order
    skipped_steps: int = 0  # non-finite steps skipped so far (train.max_skipped_steps)
    scaler_skipped_steps: int = 0  # fp16 updates the loss scaler skipped on an overflow (not faults: step.py)
    skipped_empty_steps: int = 0  # steps with no token to learn on any rank, skipped whole (step.py)
    final_train_loss: float | None = None  # the last logged train loss
    final_val_loss: float | None = None  # the last evaluation's loss ...
    final_val_step: int | None = None  # ... and the step it was measured at
    final_val_metrics: dict[str, float] | None = None  # every val_<metric> of that evaluation
    best_val_loss: float | None = None
    # A stream's position, every data-parallel rank's (data/streaming.py: {"dp_size", "ranks"}); None for data that needs only the step.
    data_position: dict[str, Any] | None = None
    # The base model a checkpoint of LoRA adapters needs (models/hf_lora.py: path and config hash); None when the
    # checkpoint holds the whole model.
    base_model: dict[str, str] | None = None

    def add_eval(self, val: dict[str, float | None], step: int) -> None:
        """An evaluation's numbers (`val`: "loss" first, then each metric): the last one's, and the best loss so far."""
        self.final_val_loss, self.final_val_step = val["loss"], step
        self.final_val_metrics = {f"val_{name}": value for name, value in val.items()}
        if val["loss"] is not None and (self.best_val_loss is None or val["loss"] < self.best_val_loss):
            self.best_val_loss = val["loss"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainingState:
        """The fields of a saved trainer_state.json; other keys (the scheduler's, the loss scaler's) are not ours."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})
