"""model.name=hf for every model.task: a BERT classifier, tagger and masked LM, a T5, a ViT (tests/hf_tiny.py).

In process: each task's model equals transformers' own from_pretrained model on a batch with padding (the batch's
other inputs reach it; renamed and prefixed weights are read as transformers reads them), a pretrained body gets a
new head with a notice, the one-line refusals. Real launches through tests/task_data.py (a data source of dict
batches registered as a user would): sequence classification on 1 process == DDP == FSDP2, its export with the run's
class names; masked LM, seq2seq and image classification train and export; a bad pairing stops in one line.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import REPO, WarmCmd, check, launch_env, run, summary, train_losses, warm_script
from parallel_train.checkpoint.export import load_weights
from parallel_train.errors import UserError
from parallel_train.models.hf import HFConfig, HFModel
from parallel_train.parallel.model_init import start_model

transformers = pytest.importorskip("transformers")

T = 16
# (model.task, tests/hf_tiny.py's folder, its Auto class)
TASKS = {
    "sequence-classification": ("bert", "AutoModelForSequenceClassification"),
    "token-classification": ("bert", "AutoModelForTokenClassification"),
    "masked-lm": ("bert", "AutoModelForMaskedLM"),
    "seq2seq": ("t5", "AutoModelForSeq2SeqLM"),
    "image-classification": ("vit", "AutoModelForImageClassification"),
}
CLASSIFIERS = ("sequence-classification", "token-classification", "image-classification")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return hf_tiny.make_task_models(tmp_path_factory.mktemp("hf_task_models"))


def started(folder, task: str, labels=None, **keys) -> HFModel:
    """The model as a run starts it: on the meta device, then filled (parallel/model_init.py)."""
    model, init = start_model(HFModel, HFConfig(name="hf", hf_path=str(folder), block_size=T, task=task, **keys), hf_tiny.VOCAB, 0, labels)
    init.fill(model, torch.device("cpu"))
    return model.eval()


def batch(task: str) -> dict[str, torch.Tensor]:
    """Two samples, the second padded after 9 tokens: the mask must reach the model for the logits to match."""
    if task == "image-classification":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))}
    ids = torch.randint(3, hf_tiny.VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 9:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if task == "seq2seq":
        inputs.update(decoder_input_ids=ids.flip(1), decoder_attention_mask=mask)
    if task == "sequence-classification":
        inputs["token_type_ids"] = (torch.arange(T) >= 8).long().expand(2, T)
    return inputs


def call(model: HFModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """As the engines call a model (data/batch.py `parts`): the main input, then the others by name."""
    main = model.main_input
    return model(inputs[main], **{k: v for k, v in inputs.items() if k != main})


# ---------------------------------------------------------------- in process


@pytest.mark.parametrize("task", list(TASKS))
def test_each_task_equals_transformers_own_model_on_a_padded_batch(folders, task):
    folder, auto = TASKS[task]
    labels = hf_tiny.LABELS if task in CLASSIFIERS else None
    model = started(folders[folder], task, labels)
    assert type(model.hf).__name__ == type(getattr(transformers, auto).from_config(model.hf.config)).__name__
    own = getattr(transformers, auto).from_pretrained(folders[folder], **({"num_labels": 3} if labels else {})).eval()
    # Only a head the folder lacks is new: every other weight is read from the files, under transformers' new names.
    assert all(name.startswith(("classifier.", "bert.pooler.")) for name in model.new_weights), model.new_weights
    state = own.state_dict()
    for name in model.new_weights:  # a new head: the run's own draw (transformers would draw another)
        state[name] = model.state_dict()[name]
    own.load_state_dict(state)
    torch.testing.assert_close(call(model, batch(task)), own(**batch(task)).logits, rtol=0, atol=1e-6)
    if labels:
        assert model.hf.config.id2label == dict(enumerate(labels)) and model.hf.config.label2id["neutral"] == 2


def test_a_pretrained_body_gets_a_new_head_with_a_notice(folders, tmp_path):
    """A masked-LM BERT fine-tuned as a classifier: its body is the folder's, the classifier (and the pooler the MLM
    lacks) start from transformers' initialisation; its MLM head is ignored. A classifier of 3 labels given 2 others: a
    new head of 2 with model.new_head=true (refused without it: tests/test_head_labels.py). A bare BertModel's weights (saved without the classifier's `bert.` prefix) are its body."""
    model = started(folders["bert"], "sequence-classification", ["no", "yes"])
    assert model.new_weights == ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    assert "classifier.weight" in model.notice and model.notice.startswith("notice:") and "\n" not in model.notice
    assert not any(name.startswith("cls.") for name in model.state_dict())
    files = load_file(str(folders["bert"] / "model.safetensors"))
    assert torch.equal(model.hf.bert.embeddings.word_embeddings.weight, files["bert.embeddings.word_embeddings.weight"])
    std = model.hf.classifier.weight.std().item()  # BERT's rule: normal(0, initializer_range 0.02)
    assert 0.01 < std < 0.03 and torch.count_nonzero(model.hf.classifier.bias) == 0
    resized = started(folders["bert-classifier"], "sequence-classification", ["no", "yes"], new_head=True)
    assert resized.new_weights == ["classifier.weight", "classifier.bias"] and resized.hf.classifier.weight.shape == (2, 32)
    body = hf_tiny.save_task_model(hf_tiny.bert_config(), "AutoModel", tmp_path / "bert_model")  # a BertModel: no "bert." prefix
    from_body = started(body, "sequence-classification", ["no", "yes"])
    assert from_body.new_weights == ["classifier.weight", "classifier.bias"]
    assert torch.equal(from_body.hf.bert.pooler.dense.weight, load_file(str(body / "model.safetensors"))["pooler.dense.weight"])
    same = started(folders["bert-classifier"], "sequence-classification", hf_tiny.LABELS)
    assert same.new_weights == [] and same.notice is None
    assert torch.equal(same.hf.classifier.weight, load_file(str(folders["bert-classifier"] / "model.safetensors"))["classifier.weight"])


def dropout_ps(model: HFModel) -> set[float]:
    """Every dropout probability the built model holds: its Dropout modules' and its attention's."""
    modules = [m.p for m in model.hf.modules() if isinstance(m, torch.nn.Dropout)]
    return {*modules, *(m.dropout_prob for m in model.hf.modules() if hasattr(m, "dropout_prob"))}


def test_model_dropout_sets_every_dropout_of_a_hub_model_and_unset_leaves_the_folders(tmp_path, capsys):
    """model.dropout on model.name=hf: BERT's hidden, attention and classifier dropout (and any architecture's keys
    holding "dropout" or "pdrop") take it, so layouts compare at dropout 0 as docs/configuration.md says; not given,
    the folder's own values stay (here 0.1, BERT's)."""
    from parallel_train.config.load import load_config
    from parallel_train.models.hf_loading import dropout_keys

    folder = hf_tiny.save_task_model(
        hf_tiny.bert_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, classifier_dropout=None), "AutoModel", tmp_path / "b"
    )
    kept = HFModel(HFConfig(name="hf", hf_path=str(folder), block_size=T, task="sequence-classification"), hf_tiny.VOCAB, hf_tiny.LABELS)
    assert dropout_ps(kept) == {0.1} and kept.hf.config.attention_probs_dropout_prob == 0.1
    for p in (0.0, 0.25):
        model = HFModel(
            HFConfig(name="hf", hf_path=str(folder), block_size=T, task="sequence-classification", dropout=p), hf_tiny.VOCAB, hf_tiny.LABELS
        )
        config = model.hf.config
        assert dropout_ps(model) == {p} and (
            config.hidden_dropout_prob,
            config.attention_probs_dropout_prob,
            config.classifier_dropout,
        ) == (p, p, p)
        inputs = batch("sequence-classification")
        assert torch.equal(call(model.train(), inputs), call(model, inputs)) == (p == 0)  # training: dropout draws, or none
    assert dropout_keys(hf_tiny.gpt2_config()) == ["resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"]
    assert dropout_keys(hf_tiny.t5_config()) == ["dropout_rate", "classifier_dropout"]
    # The key: unset by default (distinct from 0), a number in [0, 1) when given, no "ignoring" notice; GPT's stays 0.
    hf = ["model.name=hf", f"model.hf_path={folder}"]
    assert load_config(hf)[0].model.dropout is None and load_config([*hf, "model.dropout=0.2"])[0].model.dropout == 0.2
    assert "ignoring" not in capsys.readouterr().err and load_config([])[0].model.dropout == 0.0
    with pytest.raises(UserError, match=r"model.dropout: must be in \[0, 1\), got 1.0"):
        load_config([*hf, "model.dropout=1"])


def test_the_guides_bert_download_keeps_its_trained_pooler_for_the_classifier(tmp_path):
    """docs/guide.md's line that saves bert-base-cased for the recipes, run on a tiny BERT that transformers wrote with
    every pretrained head (its pooler trained, as the Hub's is): the classifier built from the saved folder starts from
    that pooler, only its classifier new; the tagger and the masked LM read the same folder (the MLM head kept)."""
    lines = {
        line
        for line in (REPO / "docs" / "guide.md").read_text().splitlines()
        if line.startswith("python -c") and "from_pretrained('bert-base-cased')" in line
    }
    assert len(lines) == 1, lines  # the NLP and the NER recipes save it alike
    code = next(iter(lines)).split('python -c "')[1].split('"')[0]
    hub, saved = tmp_path / "hub", tmp_path / "models" / "bert"
    hf_tiny.save_task_model(hf_tiny.bert_config(), "AutoModelForPreTraining", hub)
    hf_tiny.bert_tokenizer().save(str(hub / "tokenizer.json"))
    exec(code.replace("'models/bert-base-cased'", repr(str(saved))).replace("'bert-base-cased'", repr(str(hub))), {})
    pooler = {k: v for k, v in load_file(str(hub / "model.safetensors")).items() if ".pooler." in k}
    assert len(pooler) == 2
    classifier = started(saved, "sequence-classification", hf_tiny.LABELS)
    assert classifier.new_weights == ["classifier.weight", "classifier.bias"]
    for name, weight in pooler.items():
        assert torch.equal(classifier.state_dict()[name], weight), name
    assert started(saved, "token-classification", hf_tiny.LABELS).new_weights == ["classifier.weight", "classifier.bias"]
    assert started(saved, "masked-lm").new_weights == []


def test_a_causal_lm_given_an_attention_mask_runs_its_own_forward(tmp_path):
    """A causal LM's dict batch with padding: the mask reaches transformers' own forward (the pipeline layouts pass only
    the ids)."""
    model = HFModel(HFConfig(name="hf", hf_path=str(hf_tiny.save_model(hf_tiny.llama_config(), tmp_path / "llama")), block_size=T), 256)
    inputs = batch("causal-lm")
    assert model.layout is not None
    torch.testing.assert_close(call(model.eval(), inputs), model.hf(**inputs).logits, rtol=0, atol=0)
    assert not torch.allclose(call(model, inputs)[1], model(inputs["input_ids"])[1])  # the padded sample: the mask counts


def test_fsdp_units_leave_a_tied_embedding_with_the_root(folders):
    """FSDP2 shards a weight in one group: a masked-LM BERT's embeddings (tied to its decoder) stay with the root, a
    classifier's are a unit of their own; T5's shared embedding is at the root already."""
    kinds = {
        task: [type(m).__name__ for m in started(folders[TASKS[task][0]], task).decoder_layers()]
        for task in ("masked-lm", "sequence-classification", "seq2seq")
    }
    assert kinds["masked-lm"] == ["BertLayer"] * 2 and kinds["sequence-classification"] == ["BertEmbeddings", *["BertLayer"] * 2]
    assert kinds["seq2seq"] == ["T5Block"] * 4


def test_refusals_are_one_line(folders, tmp_path):
    with pytest.raises(
        UserError,
        match=r"model.task=image-classification: .* is a bert model, for which transformers has no AutoModelForImageClassification",
    ):
        HFModel(HFConfig(name="hf", hf_path=str(folders["bert"]), task="image-classification"), hf_tiny.VOCAB)
    model = HFModel(HFConfig(name="hf", hf_path=str(folders["bert"]), block_size=T, task="sequence-classification"), hf_tiny.VOCAB)
    with pytest.raises(UserError, match="model.task=sequence-classification: pipeline stages split causal language models only"):
        model.pipeline_units()
    with pytest.raises(UserError, match=r"parallel.tp=2: .*\(bert\) has no tensor-parallel plan in transformers"):
        model.tensor_parallel_plan(2)
    with pytest.raises(UserError, match=r"model.lora_rank: the new model.task=sequence-classification head \(bert.pooler.dense.weight"):
        HFModel(HFConfig(name="hf", hf_path=str(folders["bert"]), task="sequence-classification", lora_rank=4), hf_tiny.VOCAB)
    llama = hf_tiny.save_model(hf_tiny.llama_config(), tmp_path / "llama")  # a plan, but a causal LM's
    classifier = HFModel(HFConfig(name="hf", hf_path=str(llama), task="sequence-classification"), 256, ["a", "b"])
    with pytest.raises(UserError, match="parallel.tp=2: model.task=sequence-classification: tensor parallelism cuts causal"):
        classifier.tensor_parallel_plan(2)
    vit = HFModel(HFConfig(name="hf", hf_path=str(folders["vit"]), task="image-classification"), 0)
    assert vit.flops_per_token() > 0 and HFConfig(task="image-classification").inputs == "pixel values"


# ---------------------------------------------------------------- real launches (tests/task_data.py's dict batches)

# 3 steps of 4 samples; SGD, as tests/test_mesh.py compares layouts (Adam would blow float noise up into full steps).
RUN = (
    "data.source=task_batches",
    "model.name=hf",
    f"model.block_size={T}",
    "train.batch_size=4",
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.optimizer=sgd",
    "train.learning_rate=0.5",
    "train.log_interval=1",
    "eval.interval=3",
    "eval.iters=2",
    "eval.batch_size=4",
    "checkpoint.interval=3",
    "tracker=none",
)
LAYOUTS = {"one": (1, ()), "ddp": (2, ("train.batch_size=2",)), "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2"))}


def launch(nproc: int, *args: str, env=None):
    return run(WarmCmd(nproc, "tests/task_data.py", args), env=env, timeout=300)


@pytest.fixture(scope="module")
def classifier_runs(folders, tmp_path_factory):
    """A sequence classifier fine-tuned from the masked-LM BERT (a new head), as each of LAYOUTS: {name: (out, log)}."""
    tmp = tmp_path_factory.mktemp("hf_task_runs")
    task = ("model.task=sequence-classification", f"model.hf_path={folders['bert']}")
    return {
        name: (tmp / name, check(launch(n, *RUN, *task, *extra, f"output_dir={tmp / name}", env=launch_env(tmp))).output)
        for name, (n, extra) in LAYOUTS.items()
    }


# slow: a second launch of the path tests/test_recipes.py's nlp_example runs by default (1 process, DDP, FSDP2, export)
@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_classification_is_the_same_on_one_process_ddp_and_fsdp2(classifier_runs):
    (ref, log), *others = classifier_runs.values()
    assert log.count("notice: model.hf_path") == 1 and "classifier.weight, classifier.bias (a new model.task=sequence-classification" in log
    want = train_losses(ref)
    assert len(want) == 3 and want[3] < want[1]  # the new head learns
    assert "device mesh (FSDP2" in classifier_runs["fsdp2"][1] and "mesh dp_replicate 2" in classifier_runs["ddp"][1]
    for out, _ in others:
        got = train_losses(out)
        assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (out.name, got, want)
        assert summary(out)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_classifier_export_reloads_with_its_class_names_and_the_runs_logits(folders, classifier_runs, tmp_path):
    """output_dir/hf loads with AutoModelForSequenceClassification, id2label the run's class names, and gives the logits of
    the model the run saved; scripts/export.py writes the same from the FSDP2 run's sharded checkpoint."""
    out = classifier_runs["ddp"][0]
    model = HFModel(HFConfig(name="hf", hf_path=str(folders["bert"]), block_size=T, task="sequence-classification"), 300, hf_tiny.LABELS)
    model.load_state_dict(load_weights(out))
    step3 = classifier_runs["fsdp2"][0] / "checkpoints" / "step_0000003"
    check(run(warm_script("scripts/export.py", str(step3), str(tmp_path / "hf"), "--format", "hf"), env=launch_env(tmp_path)))
    for folder in (out / "hf", tmp_path / "hf"):
        exported = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        assert exported.config.id2label == dict(enumerate(hf_tiny.LABELS)) and exported.config.label2id == {
            n: i for i, n in enumerate(hf_tiny.LABELS)
        }
        torch.testing.assert_close(
            exported(**batch("sequence-classification")).logits, call(model.eval(), batch("sequence-classification")), rtol=1e-5, atol=1e-5
        )
        assert (
            transformers.AutoTokenizer.from_pretrained(folder)("ROMEO").input_ids
            == transformers.AutoTokenizer.from_pretrained(folders["bert"])("ROMEO").input_ids
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("task", ["masked-lm", "seq2seq", "image-classification"])
def test_each_other_task_trains_and_exports_for_its_auto_class(folders, task, tmp_path):
    folder, auto = TASKS[task]
    args = (*RUN, "train.max_steps=2", "eval.interval=2", "checkpoint.interval=2", f"model.task={task}", f"model.hf_path={folders[folder]}")
    check(launch(1, *args, f"output_dir={tmp_path / 'run'}", env=launch_env(tmp_path)))
    assert len(train_losses(tmp_path / "run")) == 2
    exported = getattr(transformers, auto).from_pretrained(tmp_path / "run" / "hf").eval()
    model = started(folders[folder], task, hf_tiny.LABELS if task in CLASSIFIERS else None)
    model.load_state_dict(load_weights(tmp_path / "run"))
    torch.testing.assert_close(exported(**batch(task)).logits, call(model, batch(task)), rtol=1e-5, atol=1e-5)
    if task == "image-classification":  # its image processor, and the class names
        assert transformers.AutoImageProcessor.from_pretrained(tmp_path / "run" / "hf").size == {"height": 16, "width": 16}
        assert exported.config.id2label == dict(enumerate(hf_tiny.LABELS))


@pytest.mark.multiprocess
def test_a_task_the_architecture_has_no_class_for_is_one_line_exit_2(folders, tmp_path):
    result = launch(
        1,
        *RUN,
        "model.task=image-classification",
        f"model.hf_path={folders['bert']}",
        f"output_dir={tmp_path / 'run'}",
        env=launch_env(tmp_path),
    )
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-2000:]
    assert len(errors) == 1 and "is a bert model, for which transformers has no AutoModelForImageClassification class" in errors[0]
