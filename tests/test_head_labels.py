"""A pretrained classifier's head keeps its class names (issue 34 item 2): fine-tuned on data with the same label
names, each row of the head stays the row of its name, whatever order the data's names sort in; a name the head
lacks gets a new row (the head grows, the new rows from transformers' own initialisation, named in one notice); a
head of other names or of another number of unnamed rows (LABEL_0, ...) is refused in one line naming
model.new_head=true, which starts a new head. In process: the data as a run reads it (tasks/), the model as a run
starts it (on the meta device, then filled) and built whole, the export as the run writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import check, launch_env, run, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from parallel_train.models.hf import HFModel
from parallel_train.parallel.model_init import start_model
from parallel_train.tasks.registry import TASKS

transformers = pytest.importorskip("transformers")

T = 16
TASK = "sequence-classification"
HEAD = hf_tiny.LABELS  # negative, positive, neutral: not in sorted order, so a re-sort moves rows to other names
TEXTS = ("good day", "bad day", "a day")


def classifier(folder: Path, labels: list[str] | None, tokenizer) -> Path:
    """A tiny BERT classifier written by transformers, with its tokenizer: `labels` its id2label, None for
    transformers' placeholders (LABEL_0, LABEL_1)."""
    named = dict(num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}) if labels else {}
    hf_tiny.save_task_model(hf_tiny.bert_config(**named), "AutoModelForSequenceClassification", folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast", "pad_token": "[PAD]"}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root, tokenizer = tmp_path_factory.mktemp("heads"), hf_tiny.bert_tokenizer(list(TEXTS), vocab_size=120)
    return {"named": classifier(root / "named", HEAD, tokenizer), "unnamed": classifier(root / "unnamed", None, tokenizer)}


def rows_of(tmp_path: Path, labels: list[str]) -> Path:
    """train.jsonl and validation.jsonl whose labels are `labels`, in this order, twice over."""
    for split in ("train", "validation"):
        rows = [{"text": TEXTS[i % len(TEXTS)], "label": label} for i, label in enumerate(labels * 2)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def run_of(folder: Path, data: Path, *more: str):
    """(config, data, model) as a run starts them: the data read by the task, the model on the meta device, filled."""
    cfg, _ = load_config(
        ["model.name=hf", f"model.task={TASK}", f"model.hf_path={folder}", f"data.path={data}", f"model.block_size={T}", *more]
    )
    loaded = TASKS[TASK].load(cfg, None)
    model, init = start_model(HFModel, cfg.model, loaded.vocab_size, 0, loaded.label_names)
    init.fill(model, torch.device("cpu"))
    return cfg, loaded, model.eval()


def inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 20, (2, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model: HFModel) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs()["input_ids"], attention_mask=inputs()["attention_mask"])


def original(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()(**inputs()).logits


def test_a_head_fine_tuned_on_its_own_names_keeps_each_rows_name_and_its_logits(folders, tmp_path):
    """The data's labels sort as negative, neutral, positive; the head's rows are negative, positive, neutral. Each
    label id is its name's row, and the export (no update) names each row as before and gives the original logits."""
    cfg, data, model = run_of(folders["named"], rows_of(tmp_path, ["positive", "neutral", "negative"]))
    assert data.label_names == HEAD and model.new_weights == [] and model.notice is None
    first = data.train_set.__getitems__([0, 1, 2])["labels"].tolist()
    assert first == [HEAD.index("positive"), HEAD.index("neutral"), HEAD.index("negative")]
    torch.testing.assert_close(logits(model), original(folders["named"]), rtol=0, atol=1e-6)
    HFModel.export(cfg.model, model.state_dict(), tmp_path / "hf", data.vocab, label_names=data.label_names)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["id2label"] == {str(i): name for i, name in enumerate(HEAD)}
    torch.testing.assert_close(original(tmp_path / "hf"), original(folders["named"]), rtol=0, atol=1e-6)


def test_a_name_the_head_lacks_gets_a_new_row_named_in_one_notice(folders, tmp_path):
    """The head grows by one row: its rows keep their values and names, the new one starts from BERT's own rule,
    the same on every start (meta start and a whole build alike); the notice names the new label."""
    cfg, data, model = run_of(folders["named"], rows_of(tmp_path, ["neutral", "mixed", "negative", "positive"]))
    assert data.label_names == [*HEAD, "mixed"] and model.new_weights == []
    assert model.notice.startswith("notice:") and "\n" not in model.notice and "'mixed'" in model.notice
    files = load_file(str(folders["named"] / "model.safetensors"))
    weight, bias = model.hf.classifier.weight, model.hf.classifier.bias
    assert (
        weight.shape == (4, 32) and torch.equal(weight[:3], files["classifier.weight"]) and torch.equal(bias[:3], files["classifier.bias"])
    )
    assert 0.005 < weight[3].std().item() < 0.05 and bias[3].item() == 0  # BERT's rule: normal(0, 0.02), zero bias
    assert torch.equal(run_of(folders["named"], tmp_path)[2].hf.classifier.weight, weight)
    whole = HFModel(cfg.model, data.vocab_size, data.label_names)
    assert torch.equal(whole.hf.classifier.weight[:3], files["classifier.weight"]) and whole.notice == model.notice
    torch.testing.assert_close(logits(model)[:, :3], original(folders["named"]), rtol=0, atol=1e-6)


def test_a_head_of_other_names_is_refused_unless_model_new_head(folders, tmp_path):
    data = rows_of(tmp_path, ["yes", "no"])
    with pytest.raises(UserError, match=r"model.new_head=true") as e:
        run_of(folders["named"], data)
    assert "\n" not in str(e.value) and "negative" in str(e.value)
    _, loaded, model = run_of(folders["named"], data, "model.new_head=true")
    assert loaded.label_names == ["no", "yes"] and model.hf.classifier.weight.shape == (2, 32)
    assert model.new_weights == ["classifier.weight", "classifier.bias"] and "model.new_head=true" in model.notice
    _, loaded, model = run_of(folders["named"], rows_of(tmp_path, ["positive", "negative"]), "model.new_head=true")
    assert loaded.label_names == ["negative", "positive"] and model.new_weights == ["classifier.weight", "classifier.bias"]


def test_a_head_without_names_takes_the_datas_in_order_when_the_count_matches(folders, tmp_path):
    """transformers' placeholders (LABEL_0, LABEL_1) name no class: the data's two names take the rows in their
    sorted order, which a notice says; three names are a head of another size: refused unless model.new_head."""
    _, data, model = run_of(folders["unnamed"], rows_of(tmp_path, ["yes", "no"]))
    assert data.label_names == ["no", "yes"] and model.new_weights == []
    assert "LABEL_0" in model.notice and "'no'" in model.notice and "\n" not in model.notice
    torch.testing.assert_close(logits(model), original(folders["unnamed"]), rtol=0, atol=1e-6)
    with pytest.raises(UserError, match=r"model.new_head=true"):
        run_of(folders["unnamed"], rows_of(tmp_path, ["a", "b", "c"]))
    _, data, model = run_of(folders["unnamed"], rows_of(tmp_path, ["a", "b", "c"]), "model.new_head=true")
    assert data.label_names == ["a", "b", "c"] and model.hf.classifier.weight.shape == (3, 32)


def test_a_tagger_and_an_image_classifier_keep_their_heads_names_too(folders, tmp_path):
    """run_ner's tags (O, B-PER, B-LOC, sorted B-LOC, B-PER, O) on a tagger of those tags, and an imagefolder
    (bird, cat, dog) on a ResNet whose head names dog and cat: each head's names first, in its rows' order; the
    ResNet's grows a row for bird."""
    from PIL import Image

    tags = ["O", "B-PER", "B-LOC"]
    named = dict(num_labels=3, id2label=dict(enumerate(tags)), label2id={n: i for i, n in enumerate(tags)})
    tagger = hf_tiny.save_task_model(hf_tiny.bert_config(**named), "AutoModelForTokenClassification", tmp_path / "tagger")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tagger / name).write_bytes((folders["named"] / name).read_bytes())
    for split in ("train", "validation"):
        rows = [{"tokens": ["good", "day", "a"], "ner_tags": ["B-PER", "O", "B-LOC"]}] * 4
        (tmp_path / "conll" / split).mkdir(parents=True)
        (tmp_path / "conll" / split / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, _ = load_config(["model.name=hf", "model.task=token-classification", f"model.hf_path={tagger}", f"data.path={tmp_path / 'conll'}"])
    data = TASKS["token-classification"].load(cfg, None)
    assert data.label_names == tags and [t for t in data.train_set.__getitems__([0])["labels"][0].tolist() if t >= 0] == [1, 0, 2]
    model, init = start_model(HFModel, cfg.model, data.vocab_size, 0, data.label_names)
    init.fill(model, torch.device("cpu"))
    assert model.new_weights == [] and torch.equal(
        model.hf.classifier.weight, load_file(str(tagger / "model.safetensors"))["classifier.weight"]
    )

    pets = dict(num_labels=2, id2label={0: "dog", 1: "cat"}, label2id={"dog": 0, "cat": 1})
    resnet = hf_tiny.save_task_model(hf_tiny.resnet_config(**pets), "AutoModelForImageClassification", tmp_path / "resnet")
    for name in ("bird", "cat", "dog"):
        (tmp_path / "pets" / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "pets" / name / f"{i}.png")
    keys = ["model.name=hf", "model.task=image-classification", f"model.hf_path={resnet}", "model.attn_implementation=eager"]
    cfg, _ = load_config([*keys, f"data.path={tmp_path / 'pets'}", "data.val_fraction=0.5"])
    data = TASKS["image-classification"].load(cfg, None)
    assert data.label_names == ["dog", "cat", "bird"]
    model = HFModel(cfg.model, 0, data.label_names)
    assert model.grown_weights == {"classifier.1.weight": 2, "classifier.1.bias": 2} and "'bird'" in model.notice
    assert torch.equal(model.hf.classifier[1].weight[:2], load_file(str(resnet / "model.safetensors"))["classifier.1.weight"])


@pytest.mark.slow
def test_a_run_that_learns_nothing_exports_the_head_as_it_was(folders, tmp_path):
    """The user's case through train.py: one step at a learning rate of 1e-30 (below any float32 weight's last bit) on data whose names sort otherwise than the head's
    rows; hf/ names each row as the folder did and gives the folder's logits; label_names.json is the head's order."""
    (tmp_path / "data").mkdir()
    data = rows_of(tmp_path / "data", ["positive", "neutral", "negative"])
    out = tmp_path / "run"
    keys = (
        f"model.hf_path={folders['named']}",
        f"data.path={data}",
        f"model.block_size={T}",
        "train.learning_rate=1e-30",
        "train.min_lr=0",
    )
    steps = (
        "train.max_steps=1",
        "train.warmup_steps=0",
        "train.lr_decay_steps=1",
        "eval.interval=1",
        "eval.iters=1",
        "checkpoint.interval=1",
    )
    check(
        run(
            warm_cmd(1, "model.name=hf", f"model.task={TASK}", *keys, *steps, "train.batch_size=2", "tracker=none", f"output_dir={out}"),
            env=launch_env(tmp_path),
        )
    )
    assert json.loads((out / "label_names.json").read_text()) == HEAD
    assert json.loads((out / "hf" / "config.json").read_text())["id2label"] == {str(i): name for i, name in enumerate(HEAD)}
    torch.testing.assert_close(original(out / "hf"), original(folders["named"]), rtol=0, atol=1e-6)
