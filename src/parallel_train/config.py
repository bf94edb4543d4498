"""Typed experiment config: defaults, then a YAML file, then `section.key=value` overrides.

Every key is a dataclass field with a type, a default and a one-line help (which `train.py --help`
prints, so the help never drifts from the code). `load_config` validates the result and raises a
one-line `UserError` that names the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from parallel_train.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO_ROOT / "data" / "tinyshakespeare.txt"


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field with its help text (and allowed values, if the set is closed)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = opt("gpt", "model to build (see parallel_train/models/__init__.py)")
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads per block")
    n_embd: int = opt(128, "embedding width (divisible by n_head)")
    block_size: int = opt(64, "context length in tokens")
    dropout: float = opt(0.0, "dropout probability in [0, 1)")
    bias: bool = opt(True, "bias in Linear and LayerNorm layers")
    vocab_size: int = opt(0, "0: take it from the data; else pad the vocab up to this size")
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward: less memory, about 1/3 more compute")
    in_features: int = opt(10, "mlp only: input width")
    hidden: int = opt(50, "mlp only: hidden width")
    out_features: int = opt(10, "mlp only: number of classes")


@dataclass
class DataConfig:
    path: str = opt(
        str(DEFAULT_CORPUS),
        "corpus: a local .txt/.json/.jsonl/.csv/.parquet file, a Hub dataset name, 'random' or 'synthetic' (random tokens, no download)",
    )
    tokenizer: str = opt(
        "char", "char: one id per character of the corpus; byte: one id per UTF-8 byte (256 ids)", choices=("char", "byte")
    )
    source: str = opt("text", "data loader (see parallel_train/data_sources.py): text reads data.path; add your own there")
    text_column: str = opt("text", "column holding the text in json/csv/parquet/Hub datasets")
    val_fraction: float = opt(0.1, "share of the corpus held out for validation (the last part)")
    num_samples: int = opt(64, "random data: number of samples; synthetic data: tokens in the train split")
    num_workers: int = opt(0, "DataLoader worker processes per rank (0: load in the training process)")


@dataclass
class TrainConfig:
    batch_size: int = opt(12, "samples per process per micro-step")
    gradient_accumulation_steps: int = opt(1, "micro-steps per optimizer step")
    max_steps: int = opt(2000, "optimizer steps to train for")
    optimizer: str = opt("adamw", "optimizer", choices=("adamw", "sgd"))
    learning_rate: float = opt(1e-3, "peak learning rate")
    min_lr: float = opt(1e-4, "learning rate at the end of the cosine decay")
    lr_schedule: str = opt("cosine", "learning-rate schedule", choices=("cosine", "constant"))
    warmup_steps: int = opt(100, "linear warm-up steps")
    lr_decay_steps: int = opt(2000, "step at which the cosine decay reaches min_lr")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only; biases, norms stay undecayed)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0 disables)")
    seed: int = opt(1337, "seed for weights, data order and dropout")
    log_interval: int = opt(10, "optimizer steps between train log lines")
    mixed_precision: str = opt("auto", "auto: take it from the accelerate config/launcher", choices=("auto", "no", "bf16", "fp16"))
    max_skipped_steps: int = opt(0, "0: stop at a non-finite loss/gradient; N: skip up to N such steps (costs a sync per step)")
    compile: bool = opt(False, "torch.compile the model (first steps compile, about 30 s; no gain measured on CPU)")
    tf32: bool = opt(True, "GPU only: TF32 tensor cores for fp32 matmuls and convolutions")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one device for MFU; 0: from the known-GPU table (env PEAK_TFLOPS also sets it)")


@dataclass
class EvalConfig:
    interval: int = opt(250, "optimizer steps between evaluations (0: only at the end)")
    iters: int = opt(200, "validation batches per evaluation (fixed windows, same at every eval)")
    batch_size: int = opt(0, "samples per validation batch (0: train.batch_size); iters x batch_size = the eval set")


@dataclass
class CheckpointConfig:
    interval: int = opt(500, "optimizer steps between checkpoints (0: only at the end)")
    keep: int = opt(2, "newest checkpoints to keep")
    keep_best: bool = opt(False, "also keep the checkpoint with the lowest val loss (one evaluated at its step)")


@dataclass
class ParallelConfig:
    pipeline_stages: int = opt(1, "pipeline stages the model is cut into (1: no pipeline)")
    microbatches: int = opt(1, "micro-batches per batch in the pipeline")
    schedule: str = opt("gpipe", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved1f1b"))
    stage_devices: list[str] = opt([], "devices of the stages in one process, e.g. [cuda:0,cuda:1]")
    split: str = opt(
        "auto",
        "auto (balance parameter count), time (balance measured time) or module names per stage, stages split by |: "
        "'tok_emb,pos_emb,blocks.0..1|blocks.2..3,ln_f,head'",
    )
    stages_per_rank: int = opt(2, "interleaved1f1b only: model stages each pipeline rank holds")
    timeout_s: int = opt(1800, "seconds a collective may wait before the run fails")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resume: str = opt("auto", "auto: newest valid checkpoint in output_dir, if any; none; or a checkpoint path")
    output_dir: str = opt("runs/default", "where config, metrics, checkpoints and weights go")
    tracker: str = opt("wandb", "experiment tracker (wandb goes offline without credentials)", choices=("wandb", "tensorboard", "none"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- parsing


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp):  # list[str] says what goes in the list; its __name__ would say only "list"
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/command-line value to the field's type, or raise a UserError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (list, types.GenericAlias) or tp is list:
        if isinstance(value, str):  # `key=cpu` or `key=a,b` on the command line
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list like [a,b], got {value!r}")
        return [str(v) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except ValueError:
            raise UserError(f"{key}: expected an integer, got {value!r}") from None
        if not math.isfinite(as_float) or as_float != int(as_float):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)  # also takes "1e-3", which YAML 1.1 reads as a string
        except (TypeError, ValueError):
            raise UserError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{key}: expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML 1.1 reads no/yes/off/on as booleans: `mixed_precision=no` means "no"
            return "yes" if value else "no"
        return "none" if value is None else str(value)
    raise AssertionError(f"unsupported config type {tp}")  # a bug in this file, not user input


def _set(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        fields = _fields(node)
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise UserError(f"unknown config key '{key}': {where} has {', '.join(sorted(fields))}")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(node, part)):
                raise UserError(
                    f"config key '{key}' is a section; set one of its keys, e.g. {key}.{next(iter(_fields(getattr(node, part))))}=..."
                )
            setattr(node, part, _coerce(key, value, _hints(type(node))[part]))
        else:
            node = getattr(node, part)
            if not dataclasses.is_dataclass(node):
                raise UserError(f"config key '{key}': '{'.'.join(parts[: i + 1])}' is not a section")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--config {path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of sections to keys at the top level")
    return data


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    """Split argv into (config file, [(key, value), ...]). Values are parsed as YAML scalars/lists."""
    config_path = None
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_path = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                config_path = argv[i + 1]
                i += 1
            else:
                raise UserError("--config needs a file: --config configs/NAME.yaml")
        elif "=" in arg and not arg.startswith("-"):
            key, raw = arg.split("=", 1)
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
            overrides.append((key.strip(), value))
        else:
            raise UserError(f"unexpected argument '{arg}': use --config FILE.yaml and section.key=value overrides (see --help)")
        i += 1
    return config_path, overrides


def load_config(argv: list[str]) -> tuple[Config, str | None]:
    """Defaults <- YAML file <- overrides, validated. Returns the config and the YAML path used."""
    config_path, overrides = parse_args(argv)
    cfg = Config()
    if config_path:
        for key, value in _flatten(_read_yaml(config_path)).items():
            _set(cfg, key, value)
    for key, value in overrides:
        _set(cfg, key, value)
    validate(cfg)
    return cfg, config_path


# ---------------------------------------------------------------- validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(cfg: Config) -> None:
    """Closed choices, ranges and cross-key rules. Each failure is one line naming the key."""
    for section_name, section in [("", cfg)] + [
        (f.name + ".", getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))
    ]:
        for f in dataclasses.fields(section):
            choices = f.metadata.get("choices")
            if choices and getattr(section, f.name) not in choices:
                raise UserError(f"{section_name}{f.name}: must be one of {', '.join(choices)}, got {getattr(section, f.name)!r}")

    m, t, d = cfg.model, cfg.train, cfg.data
    from parallel_train.models import MODELS  # late import: the model registry imports torch

    _check(m.name in MODELS, f"model.name: unknown model {m.name!r}; known: {', '.join(sorted(MODELS))}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "in_features", "hidden", "out_features"):
        _check(getattr(m, key) >= 1, f"model.{key}: must be >= 1, got {getattr(m, key)}")
    _check(m.n_embd % m.n_head == 0, f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout: must be in [0, 1), got {m.dropout}")
    _check(m.vocab_size >= 0, f"model.vocab_size: must be >= 0, got {m.vocab_size}")

    _check(bool(d.path), "data.path: must not be empty")
    from parallel_train.data_sources import DATA_SOURCES  # late: imports torch

    _check(d.source in DATA_SOURCES, f"data.source: unknown data source {d.source!r}; known: {', '.join(sorted(DATA_SOURCES))}")
    _check(0.0 < d.val_fraction < 1.0, f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    _check(d.num_samples >= 1, f"data.num_samples: must be >= 1, got {d.num_samples}")
    _check(d.num_workers >= 0, f"data.num_workers: must be >= 0, got {d.num_workers}")

    for key in ("batch_size", "gradient_accumulation_steps", "max_steps", "log_interval"):
        _check(getattr(t, key) >= 1, f"train.{key}: must be >= 1, got {getattr(t, key)}")
    for key in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "peak_tflops"):
        value = getattr(t, key)
        _check(math.isfinite(value) and value >= 0, f"train.{key}: must be a finite number >= 0, got {value}")
    _check(t.learning_rate > 0, "train.learning_rate: must be > 0")
    _check(t.min_lr <= t.learning_rate, f"train.min_lr ({t.min_lr}) must not exceed train.learning_rate ({t.learning_rate})")
    for key in ("warmup_steps", "lr_decay_steps", "seed"):
        _check(getattr(t, key) >= 0, f"train.{key}: must be >= 0, got {getattr(t, key)}")
    for key in ("beta1", "beta2"):
        _check(0.0 <= getattr(t, key) < 1.0, f"train.{key}: must be in [0, 1), got {getattr(t, key)}")

    _check(cfg.eval.interval >= 0, f"eval.interval: must be >= 0, got {cfg.eval.interval}")
    _check(cfg.eval.iters >= 1, f"eval.iters: must be >= 1, got {cfg.eval.iters}")
    _check(cfg.eval.batch_size >= 0, f"eval.batch_size: must be >= 0, got {cfg.eval.batch_size}")
    _check(cfg.checkpoint.interval >= 0, f"checkpoint.interval: must be >= 0, got {cfg.checkpoint.interval}")
    _check(cfg.checkpoint.keep >= 1, f"checkpoint.keep: must be >= 1, got {cfg.checkpoint.keep}")
    _check(t.max_skipped_steps >= 0, f"train.max_skipped_steps: must be >= 0, got {t.max_skipped_steps}")

    p = cfg.parallel
    _check(p.pipeline_stages >= 1, f"parallel.pipeline_stages: must be >= 1, got {p.pipeline_stages}")
    _check(p.microbatches >= 1, f"parallel.microbatches: must be >= 1, got {p.microbatches}")
    _check(p.stages_per_rank >= 1, f"parallel.stages_per_rank: must be >= 1, got {p.stages_per_rank}")
    _check(p.timeout_s >= 1, f"parallel.timeout_s: must be >= 1, got {p.timeout_s}")
    _check(
        not p.stage_devices or len(p.stage_devices) == p.pipeline_stages,
        f"parallel.stage_devices: {len(p.stage_devices)} devices given for {p.pipeline_stages} pipeline stages; give one per stage",
    )
    _check(bool(cfg.output_dir), "output_dir: must not be empty")


# ---------------------------------------------------------------- help and saving


def help_text() -> str:
    """Every key with its type, default and help, generated from the dataclasses above."""
    lines = [
        "usage: python train.py [--config FILE.yaml] [section.key=value ...]",
        "       accelerate launch [--config_file accelerate_configs/NAME.yaml] train.py [same arguments]",
        "       torchrun --nproc-per-node N train.py [same arguments]",
        "",
        "Config keys (defaults <- --config FILE.yaml <- key=value overrides):",
    ]

    def walk(node: Any, prefix: str) -> None:
        hints = _hints(type(node))
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
                continue
            choices = f.metadata.get("choices")
            kind = "|".join(choices) if choices else _type_name(hints[f.name])
            default = value if not isinstance(value, str) or value else "''"
            if isinstance(value, str) and value.startswith(str(REPO_ROOT)):
                default = Path(value).relative_to(REPO_ROOT)
            lines.append(f"  {prefix + f.name:<36} {kind:<22} default {default!s:<14} {f.metadata.get('help', '')}")

    walk(Config(), "")
    return "\n".join(lines)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from a saved config.yaml (used by resume checks and scripts/sample.py)."""
    cfg = Config()
    for key, value in _flatten(data).items():
        _set(cfg, key, value)
    return cfg
