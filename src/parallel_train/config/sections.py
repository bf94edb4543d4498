"""The run's config: its sections and keys, each a typed dataclass field with a default, a range and a one-line help
(`train.py --help` prints them, so the help never drifts from the code). load.py reads YAML files and
`section.key=value` overrides into these classes; models declare their own keys beside the model (core/model_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_train.core.fields import as_dict, opt
from parallel_train.core.model_config import ModelConfig
from parallel_train.models import MODELS

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CORPUS = REPO_ROOT / "data" / "tinyshakespeare.txt"


@dataclass
class DataConfig:
    path: str = opt(
        str(DEFAULT_CORPUS),
        "corpus: a local .txt/.json/.jsonl/.csv/.parquet file, a Hub dataset name, a folder from scripts/prepare_data.py, "
        "'random' or 'synthetic' (random tokens, no download)",
    )
    tokenizer: str = opt(
        "char",
        "char (one id per character), byte (256 ids), bpe:N (byte-level BPE trained on the corpus), word (one id per "
        "whitespace-separated word of the corpus), a tokenizer.json, a folder holding one, or a Hub tokenizer name; prepared data "
        "brings its own",
    )
    streaming: bool = opt(False, "read data.path (a folder of jsonl/parquet files or a Hub dataset) as a stream, tokenizing on the fly")
    verify: str = opt(
        "auto",
        "prepared data: size checks always; sha256 of every shard too: auto (when they total <= 1 GiB), full, size (never)",
        choices=("auto", "full", "size"),
    )
    source: str = opt("text", "data loader (see parallel_train/data/sources.py): text reads data.path; add your own there")
    format: str = opt(
        "text",
        "text: windows of one stream of text; chat: rows of messages (role, content); instruction: rows of a prompt and a "
        "completion; chat and instruction learn only the assistant's tokens (docs/guide.md section 4)",
        choices=("text", "chat", "instruction"),
    )
    chat_template: str = opt("", "chat/instruction: a jinja chat template file to use instead of the tokenizer's own")
    messages_column: str = opt("messages", "data.format=chat: the column holding each row's list of messages")
    prompt_column: str = opt("prompt", "data.format=instruction: the column holding each row's prompt")
    completion_column: str = opt("completion", "data.format=instruction: the column holding each row's completion")
    packing: bool = opt(
        False,
        "chat/instruction: pack several samples into each row of model.block_size tokens, each attending only to itself; "
        "false: one sample per row, padded to the batch's longest",
    )
    truncate: bool = opt(
        False, "chat/instruction: cut a sample longer than model.block_size + 1 tokens to that length; false: such a sample is an error"
    )
    text_column: str = opt("text", "column holding the text in json/csv/parquet/Hub datasets")
    text_columns: list[str] = opt(
        [],
        "model.task other than causal-lm: the text column(s) of each row, e.g. [question,answer] (a pair), [tokens] (words), "
        "[source]; []: the task's own (docs/data.md: sentence1,sentence2 / sentence / text; tokens; text; source or translation)",
    )
    label_column: str = opt(
        "",
        "model.task other than causal-lm: the column of each row's label(s) or target text; '': the task's own (label, ner_tags, target)",
    )
    mlm_probability: float = opt(
        0.15, "model.task=masked-lm: the share of tokens masked (80% [MASK], 10% random, 10% kept)", above=0.0, below=1.0
    )
    source_lang: str = opt("", "model.task=seq2seq on rows of a `translation` dict: the language key of the source, e.g. en")
    target_lang: str = opt("", "model.task=seq2seq on rows of a `translation` dict: the language key of the target, e.g. de")
    val_fraction: float = opt(
        0.1,
        "share held out for validation: the last part of a corpus; a fixed draw of an imagefolder without validation/",
        above=0.0,
        below=1.0,
    )
    num_samples: int = opt(64, "random data: number of samples; synthetic data: tokens in the train split", min=1)
    synthetic_padding: bool = opt(
        False, "synthetic data: each sample keeps a random number of targets and pads the rest (-100), as padded chat data does"
    )
    num_workers: int = opt(0, "DataLoader worker processes per rank (0: load in the training process)", min=0, max=1024)


@dataclass
class TrainConfig:
    batch_size: int = opt(12, "samples per process per micro-step", min=1)
    gradient_accumulation_steps: int = opt(1, "micro-steps per optimizer step", min=1)
    max_steps: int = opt(2000, "optimizer steps to train for", min=1)
    optimizer: str = opt("adamw", "optimizer", choices=("adamw", "sgd"))
    learning_rate: float = opt(1e-3, "peak learning rate", above=0.0)
    min_lr: float = opt(1e-4, "learning rate at the end of the decay", min=0.0)
    lr_schedule: str = opt(
        "cosine",
        "learning-rate schedule after the warm-up: cosine or linear down to min_lr at lr_decay_steps; wsd (warmup-stable-"
        "decay): learning_rate, then linear down over the last lr_decay_fraction of lr_decay_steps; constant (no warm-up)",
        choices=("cosine", "linear", "wsd", "constant"),
    )
    warmup_steps: int = opt(100, "linear warm-up steps", min=0)
    lr_decay_steps: int = opt(2000, "step at which the decay reaches min_lr", min=0)
    lr_decay_fraction: float = opt(0.2, "lr_schedule=wsd: the share of lr_decay_steps spent decaying (at its end)", above=0.0, max=1.0)
    weight_decay: float = opt(0.1, "AdamW weight decay, on the parameters weight_decay_params names", min=0.0)
    weight_decay_params: str = opt(
        "matrices",
        "matrices: decay parameters of 2+ dimensions only (biases, norms undecayed, close to transformers' Trainer); all: every "
        "parameter, as torch.optim.AdamW(model.parameters()) does",
        choices=("matrices", "all"),
    )
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, below=1.0)
    beta2: float = opt(0.99, "AdamW beta2", min=0.0, below=1.0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0 disables)", min=0.0)
    # The data order's generator is seeded with seed * 100_003 + epoch (data/batch_sampler.py): it must fit in 64 bits.
    seed: int = opt(1337, "seed for weights, data order and dropout", min=0, max=2**32 - 1)
    log_interval: int = opt(10, "optimizer steps between train log lines", min=1)
    mixed_precision: str = opt("auto", "auto: take it from the accelerate config/launcher", choices=("auto", "no", "bf16", "fp16"))
    max_skipped_steps: int = opt(0, "0: stop at a non-finite loss/gradient; N: skip up to N such steps (costs a sync per step)", min=0)
    compile: bool = opt(False, "torch.compile the model (first steps compile, about 30 s; no gain measured on CPU)")
    tf32: bool = opt(True, "GPU only: TF32 tensor cores for fp32 matmuls and convolutions")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one device for MFU; 0: from the known-GPU table (env PEAK_TFLOPS also sets it)", min=0.0)


@dataclass
class EvalConfig:
    interval: int = opt(250, "optimizer steps between evaluations (0: only at the end)", min=0)
    iters: int = opt(
        200, "validation batches per evaluation (fixed windows, same at every eval); 0: the whole validation split, each sample once", min=0
    )
    batch_size: int = opt(
        0,
        "samples per validation batch across all data-parallel ranks (0: train.batch_size x data-parallel ranks); "
        "iters x batch_size = the eval set, the same on every layout",
        min=0,
    )
    metric: str = opt(
        "",
        "your own validation metric, FILE.py:FUNCTION: FUNCTION(logits, labels) gives a (batch, K) tensor of per-sample "
        "statistics; logged as val_FUNCTION, the first column's sum over the second's, or FUNCTION_value(totals) of the file "
        "(docs/observing.md)",
    )


@dataclass
class CheckpointConfig:
    interval: int = opt(500, "optimizer steps between checkpoints (0: only at the end)", min=0)
    keep: int = opt(2, "newest checkpoints to keep", min=1)
    keep_best: bool = opt(False, "also keep the checkpoint with the lowest val loss (one evaluated at its step)")
    async_: bool = opt(False, "write checkpoints in the background: training waits only for a copy of the state")


@dataclass
class ParallelConfig:
    # The device mesh (parallel/mesh.py): dp_replicate x dp_shard x cp x pipeline_stages x tp processes, all of them.
    dp_replicate: int = opt(
        1, "data-parallel replicas (whole copies, or HSDP groups with dp_shard); all mesh keys 1: fill the world", min=1
    )
    dp_shard: int = opt(1, "FSDP2: processes that shard parameters, gradients and optimizer state (1: none)", min=1)
    tp: int = opt(1, "tensor parallel: processes that split every layer (by heads / columns; the model's plan)", min=1)
    cp: int = opt(
        1, "context parallel: processes that split every sequence (each holds block_size/cp tokens; attention by heads/cp)", min=1
    )
    pipeline_stages: int = opt(1, "pipeline stages the model is cut into (1: no pipeline)", min=1)
    ep: int = opt(
        1, "expert parallelism: the GPT's experts split over this many dp_shard ranks, tokens sent by all-to-all (1: none)", min=1
    )
    microbatches: int = opt(1, "micro-batches per batch in the pipeline", min=1)
    schedule: str = opt(
        "gpipe",
        "pipeline schedule (zbv, dualpipev, interleavedzb: zero bubble, 2 stages per rank)",
        choices=("gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv", "dualpipev"),
    )
    stage_devices: list[str] = opt([], "devices of the stages in one process, e.g. [cuda:0,cuda:1]")
    timeline: bool = opt(
        True,
        "pipelines: time the stages' passes for the schedule picture and the measured bubble (every step on CPU; on GPUs "
        "1 in 10, with CUDA events and one wait for the device on that step); false: no timing",
    )
    split: str = opt(
        "auto",
        "auto (balance parameter count), time (balance measured time) or module names per stage, stages split by |: "
        "'tok_emb,pos_emb,blocks.0..1|blocks.2..3,ln_f,head'",
    )
    stages_per_rank: int = opt(2, "interleaved1f1b, interleavedzb: model stages each pipeline rank holds (zbv, dualpipev: 2)", min=1)
    reduce_every_microstep: bool = opt(
        False,
        "FSDP2 with accumulation: reduce-scatter gradients after every micro-step (sharded gradients only, A x the "
        "communication); false: once per optimizer step (holds unsharded gradients until then)",
    )
    # datetime.timedelta and the collectives' C++ millisecond timeouts accept this much.
    timeout_s: int = opt(1800, "seconds a collective may wait before the run fails", min=1, max=10**8)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: MODELS["gpt"].Config())  # the chosen model's class
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resume: str = opt("auto", "auto: newest valid checkpoint in output_dir, if any; none; or a checkpoint path")
    output_dir: str = opt("runs/default", "where config, metrics, checkpoints and weights go")
    tracker: str = opt("wandb", "experiment tracker (wandb goes offline without credentials)", choices=("wandb", "tensorboard", "none"))

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self)
