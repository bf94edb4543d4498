"""No setting silently ignored (config/usage.py): a key the user set that this run does not read is listed in one
start notice, or refused where ignoring it would train something else than asked; defaults, keys set to their default
and saved configs say nothing. One case per row of the table, in process (load_config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_train.config.load import config_from_dict, load_config, save_config
from parallel_train.config.usage import BY_KEY, ROWS, table_markdown
from parallel_train.errors import UserError
from parallel_train.models.hf import HFConfig
from parallel_train.run.resume_config import config_changes

REPO = Path(__file__).resolve().parents[1]
HF = ["model.name=hf", "model.hf_path={hf}"]
PREPARED = "data.path={prepared}"
MINE = "data.source=mine"
SEQ2SEQ = [*HF, "model.task=seq2seq"]

# key -> (a value other than its default, settings under which it is not read, settings under which it is)
CASES = {
    "data.chat_template": ("t.jinja", [], ["data.format=chat"]),
    "data.packing": ("true", [], ["data.format=instruction"]),
    "data.truncate": ("true", [], ["data.format=chat"]),
    "data.messages_column": ("conv", ["data.format=instruction"], ["data.format=chat"]),
    "data.prompt_column": ("q", ["data.format=chat"], ["data.format=instruction"]),
    "data.completion_column": ("a", [], ["data.format=instruction"]),
    "data.text_column": ("body", ["data.path=corpus.txt"], ["data.path=rows.jsonl"]),
    "data.tokenizer": ("byte", ["data.path=synthetic"], []),
    # No model serves these tasks yet (config/load.py refuses them): read by a data source of one's own.
    "data.text_columns": ("[question,answer]", [], [MINE]),
    "data.label_column": ("y", [], [MINE]),
    "data.mlm_probability": ("0.2", [], [MINE]),
    # Rows of source and target columns: no translation dict to read the languages from (issue 34).
    "data.source_lang": ("en", [*SEQ2SEQ, "data.path={pairs}"], [MINE]),
    "data.target_lang": ("de", [*SEQ2SEQ, "data.path={pairs}"], [*SEQ2SEQ, "data.path={wmt}"]),
    # A folder with its own validation split (issue 34), as a text task or an imagefolder reads it.
    "data.val_fraction": (
        "0.2",
        [*HF, "model.task=sequence-classification", "data.path={glue}"],
        [*HF, "model.task=sequence-classification", "data.path={pairs}"],
    ),
    "data.num_samples": ("10", [], ["data.path=synthetic"]),
    "data.synthetic_padding": ("true", ["data.path=random", "model.name=mlp"], ["data.path=synthetic"]),
    "data.verify": ("full", [], [PREPARED]),
    "model.vocab_size": ("512", HF, []),
    "model.new_head": ("true", HF, [*HF, "model.task=token-classification"]),
    "model.lora_alpha": ("8", HF, [*HF, "model.lora_rank=4"]),
    "model.lora_dropout": ("0.1", HF, [*HF, "model.lora_rank=4"]),
    "model.lora_targets": ("[q_proj]", HF, [*HF, "model.lora_rank=4"]),
    "model.lora_experts": ("true", HF, [*HF, "model.lora_rank=4"]),
    "train.beta1": ("0.8", ["train.optimizer=sgd"], []),
    "train.beta2": ("0.9", ["train.optimizer=sgd"], []),
    "train.weight_decay": ("0.0", ["train.optimizer=sgd"], []),
    "train.weight_decay_params": ("all", ["train.optimizer=sgd"], []),
    "train.lr_decay_fraction": ("0.5", [], ["train.lr_schedule=wsd"]),
    "model.selective_ac": ("2", [], ["model.activation_checkpointing=selective"]),
    "train.warmup_steps": ("5", ["train.lr_schedule=constant"], ["train.lr_schedule=linear"]),
    "train.min_lr": ("0.0", ["train.lr_schedule=constant"], []),
    "train.lr_decay_steps": ("50", ["train.lr_schedule=constant"], []),
    "model.experts_per_token": ("1", [], ["model.n_experts=4"]),
    "model.rope_theta": ("500", [], ["model.flavor=llama"]),
    "model.bias": ("false", ["model.flavor=llama"], []),
    "model.moe_aux_loss_coef": ("0.0", [], ["model.n_experts=4"]),
    "parallel.microbatches": ("4", [], ["parallel.pipeline_stages=2"]),
    "parallel.schedule": ("1f1b", [], ["parallel.pipeline_stages=2"]),
    "parallel.split": ("time", [], ["parallel.pipeline_stages=2"]),
    "parallel.timeline": ("false", [], ["parallel.pipeline_stages=2"]),
    "parallel.stages_per_rank": ("3", ["parallel.pipeline_stages=2"], ["parallel.pipeline_stages=2", "parallel.schedule=interleaved1f1b"]),
}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def places(tmp_path):
    """A model folder (the config layer only checks it holds config.json), a prepared-data folder, seq2seq rows of
    source and target columns and of translation dicts, and a folder of rows with its own validation split."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "prepared.json").write_text("{}")
    (tmp_path / "glue").mkdir()
    for split in ("train", "validation"):
        jsonl(tmp_path / "glue" / f"{split}.jsonl", [{"sentence": "hear me", "label": i % 2} for i in range(4)])
    return {
        "hf": tmp_path / "hf",
        "prepared": tmp_path / "prepared",
        "pairs": jsonl(tmp_path / "pairs.jsonl", [{"source": "hear me", "target": "speak all"}] * 4),
        "wmt": jsonl(tmp_path / "wmt.jsonl", [{"translation": {"en": "hear me", "de": "hoert mich"}}] * 4),
        "glue": tmp_path / "glue",
    }


def load(args: list[str], places) -> None:
    """load_config on `args`, the places filled in."""
    load_config([a.format(**places) for a in args])


def test_every_row_has_a_case():
    assert set(CASES) == set(BY_KEY)


@pytest.mark.parametrize("key", list(BY_KEY))
def test_a_key_the_run_does_not_read_is_named_once_or_refused(key, places, capsys):
    value, unread, read = CASES[key]
    row = BY_KEY[key]
    if row.refuse:
        with pytest.raises(UserError, match=f"^{key}: "):
            load([*unread, f"{key}={value}"], places)
    else:
        load([*unread, f"{key}={value}"], places)
        notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
        assert len(notices) == 1 and f"{key} (read only with {row.when})" in notices[0], notices
    load([*read, f"{key}={value}"], places)  # where it is read: nothing to say
    assert "notice" not in capsys.readouterr().err


def test_sample_keys_with_text_data_are_one_notice_and_a_chat_template_a_refusal(capsys):
    """The issue's example: data.truncate and data.messages_column with windows of text were dropped without a word.
    The notice is one line, and keeps the other model's keys in it."""
    load_config(["data.truncate=true", "data.messages_column=conv", "data.prompt_column=q", "model.name=mlp", "model.n_embd=64"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("notice: ignoring "), err
    for item in (
        "model.n_embd (a key of model.name=gpt, not of model.name=mlp)",
        "data.truncate (read only with data.format=chat or instruction)",
        "data.messages_column (read only with data.format=chat)",
        "data.prompt_column (read only with data.format=instruction)",
    ):
        assert item in err, err
    with pytest.raises(UserError, match=r"^data.chat_template: applies to samples \(data.format=chat or instruction\)"):
        load_config(["data.chat_template=mine.jinja"])


def test_keys_the_data_makes_unread_are_named_in_one_notice(places, capsys):
    """Issue 34: data.val_fraction beside the data's own validation split, and the languages of seq2seq rows that are
    source and target columns, were ignored without a word; the seq2seq data.label_column names a target column too."""
    folder = places["pairs"].parent / "pairs_split"
    folder.mkdir()
    for split in ("train", "validation"):
        jsonl(folder / f"{split}.jsonl", [{"source": "hear me", "target": "speak all"}] * 4)
    keys = ["data.val_fraction=0.2", "data.source_lang=en", "data.target_lang=de"]
    load([*SEQ2SEQ, f"data.path={folder}", *keys], places)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and all(f"{key.split('=')[0]} (read only with" in notices[0] for key in keys), notices
    load([*SEQ2SEQ, "data.path={wmt}", "data.label_column=de_text", *keys[1:]], places)  # a target column named
    assert "data.source_lang (read only with" in capsys.readouterr().err
    load([*SEQ2SEQ, "data.path={wmt}", *keys], places)  # translation dicts, no validation split: every key read
    assert capsys.readouterr().err == ""


def test_defaults_shipped_configs_and_saved_configs_say_nothing(tmp_path, capsys):
    """Only what the user set, and only values other than the default: a saved config.yaml given back as --config
    lists every key (most at their defaults) and says nothing; config_from_dict (resume, scripts) never checks."""
    load_config([])
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name == "cv_example.yaml" and "image-classification" not in HFConfig.tasks:
            continue  # model.name=hf serves images once it is merged (tests/test_image_data.py loads it then)
        load_config(["--config", str(path)])
    cfg, _ = load_config(["data.truncate=false", "parallel.schedule=gpipe"])  # set, but to their defaults
    save_config(cfg, tmp_path / "config.yaml")
    load_config(["--config", str(tmp_path / "config.yaml")])
    config_from_dict({"data": {"truncate": True, "messages_column": "conv"}, "train": {"optimizer": "sgd", "beta1": 0.5}})
    assert capsys.readouterr().err == ""


def test_a_key_the_run_does_not_read_may_change_on_resume(tmp_path):
    """train.weight_decay under SGD defines nothing (the seed MLP's config no longer sets it): a checkpoint that has
    another value resumes; under AdamW it is refused as before."""
    for optimizer, refused in (("sgd", False), ("adamw", True)):
        saved, _ = load_config([f"train.optimizer={optimizer}", "train.weight_decay=0.0"])
        (tmp_path / optimizer).mkdir()
        save_config(saved, tmp_path / optimizer / "config.yaml")
        now, _ = load_config([f"train.optimizer={optimizer}"])
        if refused:
            with pytest.raises(UserError, match="train.weight_decay"):
                config_changes(tmp_path / optimizer, now)
        else:
            assert config_changes(tmp_path / optimizer, now) == {}


def test_the_table_is_documented():
    assert table_markdown() in (REPO / "docs" / "configuration.md").read_text()
    assert len(ROWS) == len(BY_KEY)  # a key has one row
