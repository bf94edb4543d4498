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


def started(folder, task: str, labels=None) -> HFModel:
    """The model as a run starts it: on the meta device, then filled (parallel/model_init.py)."""
    model, init = start_model(HFModel, HFConfig(name="hf", hf_path=str(folder), block_size=T, task=task), hf_tiny.VOCAB, 0, labels)
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
    state = own.state_dict()
    for name in model.new_weights:  # a new head: the run's own draw (transformers would draw another)
        state[name] = model.state_dict()[name]
    own.load_state_dict(state)
    torch.testing.assert_close(call(model, batch(task)), own(**batch(task)).logits, rtol=0, atol=1e-6)
    if labels:
        assert model.hf.config.id2label == dict(enumerate(labels)) and model.hf.config.label2id["neutral"] == 2


def test_a_pretrained_body_gets_a_new_head_with_a_notice(folders):
    """A masked-LM BERT fine-tuned as a classifier: its body is the folder's, the classifier (and the pooler the MLM
    lacks) start from transformers' initialisation; its MLM head is ignored. A classifier of 3 labels given 2: a new
    head of 2."""
    model = started(folders["bert"], "sequence-classification", ["no", "yes"])
    assert model.new_weights == ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    assert "classifier.weight" in model.notice and model.notice.startswith("notice:") and "\n" not in model.notice
    assert not any(name.startswith("cls.") for name in model.state_dict())
    files = load_file(str(folders["bert"] / "model.safetensors"))
    assert torch.equal(model.hf.bert.embeddings.word_embeddings.weight, files["bert.embeddings.word_embeddings.weight"])
    std = model.hf.classifier.weight.std().item()  # BERT's rule: normal(0, initializer_range 0.02)
    assert 0.01 < std < 0.03 and torch.count_nonzero(model.hf.classifier.bias) == 0
    resized = started(folders["bert-classifier"], "sequence-classification", ["no", "yes"])
    assert resized.new_weights == ["classifier.weight", "classifier.bias"] and resized.hf.classifier.weight.shape == (2, 32)
    same = started(folders["bert-classifier"], "sequence-classification", hf_tiny.LABELS)
    assert same.new_weights == [] and same.notice is None
    assert torch.equal(same.hf.classifier.weight, load_file(str(folders["bert-classifier"] / "model.safetensors"))["classifier.weight"])


def test_refusals_are_one_line(folders):
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
    vit = HFModel(HFConfig(name="hf", hf_path=str(folders["vit"]), task="image-classification"), 0)
    assert vit.flops_per_token() > 0 and HFConfig(task="image-classification").inputs == "pixel values"
