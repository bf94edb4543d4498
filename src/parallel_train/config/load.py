"""Reading the run's config: defaults, then YAML files, then `section.key=value` overrides.

Every key is a dataclass field with a type, a default and a one-line help (which `train.py --help`
prints, so the help never drifts from the code). `load_config` validates the result and raises a
one-line `UserError` that names the offending key.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import yaml

from parallel_train.config import usage
from parallel_train.config.sections import REPO_ROOT, Config
from parallel_train.core.fields import check, check_section, coerce, fields_of, hints, key_name, type_name
from parallel_train.core.model_config import ModelConfig
from parallel_train.errors import UserError, is_first_process
from parallel_train.models import MODELS

# ---------------------------------------------------------------- parsing


def model_class(name: str) -> type[ModelConfig]:
    check(name in MODELS, f"model.name: unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name].Config


def other_models_key(key: str) -> str | None:
    """The model whose own key `key` is (for `model.<key>` given while another model is chosen), if any."""
    return next((name for name, cls in MODELS.items() if key in fields_of(cls.Config)), None)


def _set(cfg: Config, key: str, value: Any, ignored: list[str] | None = None) -> None:
    parts = key.split(".")
    if parts[0] == "model" and len(parts) == 2 and parts[1] not in fields_of(cfg.model):
        owner = other_models_key(parts[1])
        why = getattr(MODELS[owner].Config, "exclusive", {}).get(parts[1]) if owner is not None else None
        if why and ignored is not None:  # e.g. model.lora_rank for the GPT: ignoring it would train something else than asked
            raise UserError(
                f"{key}: a key of model.name={owner} only ({why}), not of model.name={cfg.model.name}; drop it or use model.name={owner}"
            )
        if owner is not None and ignored is not None:  # e.g. model.n_embd for the MLP: not its key, harmless
            ignored.append(f"{key} (a key of model.name={owner}, not of model.name={cfg.model.name})")
            return
        if owner is not None:  # a saved config from before models owned their keys held every model's keys
            return
    node: Any = cfg
    for i, part in enumerate(parts):
        fields = fields_of(node)
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            if where == "model":
                where = f"model.name={cfg.model.name}"
            raise UserError(f"unknown config key '{key}': {where} has {', '.join(sorted(fields))}")
        if i == len(parts) - 1:
            name = fields[part].name  # `async_` for the key `async`
            if dataclasses.is_dataclass(getattr(node, name)):
                raise UserError(
                    f"config key '{key}' is a section; set one of its keys, e.g. {key}.{next(iter(fields_of(getattr(node, name))))}=..."
                )
            value = coerce(key, value, hints(type(node))[name])
            aliases = fields[part].metadata.get("aliases") or {}  # e.g. model.activation_checkpointing=true: full
            setattr(node, name, aliases.get(value, value) if isinstance(value, str) else value)
        else:
            node = getattr(node, fields[part].name)
            if not dataclasses.is_dataclass(node):
                raise UserError(f"config key '{key}': '{'.'.join(parts[: i + 1])}' is not a section")


def _apply(settings: list[tuple[str, Any]], ignored: list[str] | None) -> Config:
    """A Config from (key, value) settings in order. model.name goes first: it decides which keys model.* has."""
    names = [value for key, value in settings if key == "model.name"]
    cfg = Config(model=model_class(coerce("model.name", names[-1], str) if names else "gpt")())
    for key, value in settings:
        _set(cfg, key, value, ignored)
    if cfg.model.own_tokenizer() and not any(key == "data.tokenizer" for key, _ in settings):
        cfg.data.tokenizer = cfg.model.own_tokenizer()  # e.g. a Hugging Face model's: its ids mean nothing otherwise
    return cfg


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int):
        super().__init__(f"key {key!r} is written twice")
        self.key, self.first, self.second = key, first, second


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping: plain YAML keeps the last one, so a second
    `model:` section would silently drop the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys written here override the merged ones
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(key, seen[key], line)
            except TypeError:  # an unhashable key: construct_mapping below says so
                continue
            seen[key] = line
        return super().construct_mapping(node, deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeyLoader.construct_mapping)


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        data = yaml.load(p.read_text(), Loader=UniqueKeyLoader)
    except DuplicateKey as e:
        raise UserError(
            f"--config {path}: key {e.key!r} is written twice (lines {e.first} and {e.second}); YAML would keep only the second: "
            "merge them into one"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--config {path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of sections to keys at the top level")
    return data


def parse_args(argv: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Split argv into ([config file, ...], [(key, value), ...]). Values are parsed as YAML scalars/lists."""
    config_paths: list[str] = []
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_paths.append(arg.split("=", 1)[1])
            elif i + 1 < len(argv):
                config_paths.append(argv[i + 1])
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
    return config_paths, overrides


def load_config(argv: list[str]) -> tuple[Config, str | None]:
    """Defaults <- YAML files (in the order given: a later file wins) <- overrides, validated. Returns the config
    and the YAML files used, joined by ' + ' for the start banner (None without one)."""
    config_paths, overrides = parse_args(argv)
    settings = [item for path in config_paths for item in flatten(_read_yaml(path)).items()]
    ignored: list[str] = []
    cfg = _apply(settings + overrides, ignored)
    validate(cfg)
    # Only the keys the user set: a default is never news, and a saved config (config_from_dict) is never checked.
    ignored += usage.unread(cfg, [key for key, _ in settings + overrides])
    if ignored and is_first_process():
        print(f"notice: ignoring {', '.join(ignored)}: this run does not read them", file=sys.stderr, flush=True)
    return cfg, " + ".join(config_paths) or None


# ---------------------------------------------------------------- validation


def sections(cfg: Config) -> list[tuple[str, Any]]:
    """(prefix, section) for the top level and every section: `("", cfg)`, `("model.", cfg.model)`, ..."""
    return [("", cfg)] + [
        (f.name + ".", getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))
    ]


def validate(cfg: Config) -> None:
    """Choices and ranges of every key (from the fields), the chosen model's own rules, then the rules between
    sections. Each failure is one line naming the key."""
    for prefix, section in sections(cfg):
        check_section(section, prefix)
    cfg.model.check()
    m = cfg.model
    check(
        m.task in m.tasks,
        f"model.task={m.task}: model.name={m.name} is built for {', '.join(m.tasks)} only; "
        "use model.name=hf with a transformers model of that task, or a model of your own that lists it in its Config.tasks",
    )

    t, p = cfg.train, cfg.parallel
    d = cfg.data
    check(
        d.format == "text" or not d.streaming,
        f"data.format={d.format}: samples are read whole (in memory, or prepared with scripts/prepare_data.py --format {d.format}), "
        "not streamed; drop data.streaming",
    )
    if d.packing:  # the model must keep packed samples apart: it takes their positions (data/batch.py)
        forward = getattr(MODELS[cfg.model.name], "forward", None)
        check(
            "positions" in inspect.signature(forward).parameters,
            f"data.packing: model.name={cfg.model.name} does not take a packed batch's positions (forward(x, positions=None)), "
            "so its samples would attend to each other; set data.packing=false, or see models/gpt.py",
        )
        check(p.tp == 1, f"data.packing with parallel.tp={p.tp}: not supported here; use parallel.dp_shard, or data.packing=false")
    experts = getattr(m, "n_experts", 0)
    check(
        p.ep == 1 or (cfg.model.name == "gpt" and experts) or cfg.model.name == "hf",
        f"parallel.ep={p.ep}: expert parallelism splits the GPT's or a Hugging Face MoE's experts, and "
        f"{'model.n_experts=0 makes it dense' if cfg.model.name == 'gpt' else f'model.name={cfg.model.name} has none'}; "
        "set model.name=gpt with model.n_experts > 0, or model.name=hf with a MoE, or parallel.ep=1",
    )
    check(
        not experts or experts % p.ep == 0,
        f"model.n_experts={experts} is not divisible by parallel.ep={p.ep}: each EP rank holds n_experts / ep experts; choose them so",
    )
    check(
        not (getattr(m, "lora_experts", False) and p.ep > 1),
        f"model.lora_experts with parallel.ep={p.ep}: the experts' adapters cover every expert, and EP splits the experts; "
        "set parallel.ep=1 (FSDP2 shards the experts) or model.lora_experts=false (LoRA on attention, the experts frozen and split)",
    )
    if getattr(m, "n_experts", 0):  # models/moe.py: the multi-process pipeline carries its balancing loss (pipeline/balance.py)
        check(
            not p.stage_devices,
            f"model.n_experts={m.n_experts} with parallel.stage_devices: the in-process pipeline does not carry the router's "
            "balancing loss; leave parallel.stage_devices empty and launch one process per stage",
        )
    check(t.min_lr <= t.learning_rate, f"train.min_lr ({t.min_lr}) must not exceed train.learning_rate ({t.learning_rate})")
    check(  # else the warm-up runs into the floor: no stable phase, no decay, the peak never (or once) reached
        t.lr_schedule != "wsd" or t.warmup_steps < t.lr_decay_steps,
        f"train.warmup_steps={t.warmup_steps}: with train.lr_schedule=wsd the warm-up must end before train.lr_decay_steps="
        f"{t.lr_decay_steps} (where the decay ends), or the rate drops from the warm-up straight to train.min_lr without its "
        "stable phase at train.learning_rate and its decay; lower train.warmup_steps or raise train.lr_decay_steps",
    )
    check(
        not p.stage_devices or len(p.stage_devices) == p.pipeline_stages,
        f"parallel.stage_devices: {len(p.stage_devices)} devices given for {p.pipeline_stages} pipeline stages; give one per stage",
    )


# ---------------------------------------------------------------- help and saving


def _key_lines(node: Any, prefix: str, skip: set[str] = frozenset()) -> list[str]:
    """One line per key of `node` (recursing into sections): name, type, default, help."""
    lines = []
    types_ = hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(value):
            lines += _key_lines(value, prefix + f.name + ".")
            continue
        choices = f.metadata.get("choices")
        kind = "|".join(choices) if choices else type_name(types_[f.name])
        default = value if not isinstance(value, str) or value else "''"
        if isinstance(value, str) and value.startswith(str(REPO_ROOT)):
            default = Path(value).relative_to(REPO_ROOT)
        lines.append(f"  {prefix + key_name(f.name):<36} {kind:<22} default {default!s:<14} {f.metadata.get('help', '')}")
    return lines


def help_text() -> str:
    """Every key with its type, default and help, generated from the dataclasses (each model's keys grouped)."""
    lines = [
        "usage: python train.py [--config FILE.yaml ...] [section.key=value ...]",
        "       accelerate launch [--config_file accelerate_configs/NAME.yaml] train.py [same arguments]",
        "       torchrun --nproc-per-node N train.py [same arguments]",
        "",
        "Config keys (defaults <- each --config FILE.yaml in order <- key=value overrides):",
    ]
    common = {f.name for f in dataclasses.fields(ModelConfig)}
    lines += _key_lines(ModelConfig(), "model.")
    for name, model in MODELS.items():
        lines.append(f"  with model.name={name}:")
        lines += _key_lines(model.Config(name=name), "model.", skip=common)
    defaults = Config()
    lines += _key_lines(defaults, "", skip={"model"})
    return "\n".join(lines)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from a saved config.yaml (used by resume checks and scripts/sample.py). Keys of other
    models are skipped silently: configs saved before models owned their keys list every model's keys."""
    return _apply(list(flatten(data).items()), ignored=None)
