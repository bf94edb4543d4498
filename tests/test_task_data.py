"""Task data without code (issue 27 item 3): run_glue, run_ner, run_mlm, run_translation and run_summarization rows
read by each task's `load` (tasks/), in process, with a BERT-style WordPiece made here (hf_tiny.bert_tokenizer):
the batches, their shapes and fixed length, the alignment of labels, the -100s, the masks' determinism, the class
names, the resume refusal and the bad inputs as one line each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import hf_tiny
from parallel_train.config.load import config_from_dict
from parallel_train.data.text import train_loader, val_loader
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.run.resume_config import check_same_files
from parallel_train.tasks.registry import TASKS
from parallel_train.tasks.seq2seq import shift_right

T = 24  # model.block_size
PAD, UNK, CLS, SEP, MASK = range(5)
WORDS = "first citizen before we proceed any further hear me speak all speak speak".split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    """A tokenizer folder: tokenizer.json and a tokenizer_config.json, as a BERT model's folder holds them."""
    folder = tmp_path_factory.mktemp("bert")
    hf_tiny.bert_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"mask_token": "[MASK]", "pad_token": "[PAD]"}))
    return folder


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(task: str, path: Path, tok: Path | str | None, **keys):
    """TASKS[task].load on a config of these keys (section__key=value); tok None: data.tokenizer's default."""
    tree = {"model": {"task": task, "block_size": T}, "data": {"path": str(path)}, "train": {"seed": 7}}
    if tok is not None:
        tree["data"]["tokenizer"] = str(tok)
    for key, value in keys.items():
        section, name = key.split("__")
        tree.setdefault(section, {})[name] = value
    return TASKS[task].load(config_from_dict(tree), None)


def batch(dataset, indices=None):
    return dataset.__getitems__(list(range(len(dataset))) if indices is None else indices)


def glue_rows(n: int = 20) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"sentence1": " ".join(rng.choice(WORDS, 4)), "sentence2": " ".join(rng.choice(WORDS, 30)), "label": ["no", "yes"][i % 2]}
        for i in range(n)
    ]


def test_sentence_pairs_are_the_tokenizers_own_encoding_cut_to_block_size(tmp_path, tok):
    rows = glue_rows()
    data = load("sequence-classification", jsonl(tmp_path / "mrpc.jsonl", rows), tok)
    b = batch(data.train_set)
    assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert b["input_ids"].shape == (18, T) and b["labels"].shape == (18,) and b["input_ids"].dtype == torch.int64
    core = Tokenizer.from_file(str(tok / "tokenizer.json"))
    core.enable_truncation(T)  # transformers' truncation=True: the longer text is cut first
    for i in (0, 5):
        e = core.encode(rows[i]["sentence1"], rows[i]["sentence2"])
        n = len(e.ids)
        assert n == T, "the second text is long: the pair fills the block"
        assert b["input_ids"][i].tolist() == e.ids and b["token_type_ids"][i].tolist() == e.type_ids
        assert b["input_ids"][i, 0] == CLS and (b["input_ids"][i] == SEP).sum() == 2 and b["attention_mask"][i].all()
    assert data.label_names == ["no", "yes"] and b["labels"].tolist() == [i % 2 for i in range(18)]
    assert len(data.val_set) == 2 and batch(data.val_set)["labels"].tolist() == [0, 1]  # the last data.val_fraction, in file order
    assert data.all_targets_count and json.loads(data.files["label_names.json"]) == ["no", "yes"]
    assert data.files["tokenizer_config.json"] == (tok / "tokenizer_config.json").read_text()  # travels with the run
    saved = json.loads(data.vocab.files()["tokenizer.json"])  # what the run saves: the folder's, no padding or truncation added
    assert saved == json.loads((tok / "tokenizer.json").read_text()) and saved["padding"] is None


def test_single_sentences_from_csv_pad_with_the_pad_id_and_sort_numeric_labels_as_numbers(tmp_path, tok):
    csv = tmp_path / "sst2.csv"
    csv.write_text("sentence,label\n" + "".join(f"speak all,{[10, 2, 1][i % 3]}\n" for i in range(12)))
    data = load("sequence-classification", csv, tok)
    b = batch(data.train_set)
    assert "token_type_ids" not in b, "a single text: every model's default type ids, not a key every model takes"
    length = int(b["attention_mask"][0].sum())
    assert length < T and (b["input_ids"][0, length:] == PAD).all() and b["input_ids"][0, length - 1] == SEP
    assert data.label_names == ["1", "2", "10"] and b["labels"][:3].tolist() == [2, 1, 0]


def test_a_folder_of_files_validates_on_its_validation_files(tmp_path, tok):
    (tmp_path / "glue").mkdir()
    jsonl(tmp_path / "glue" / "train.jsonl", glue_rows(8))
    jsonl(tmp_path / "glue" / "validation.jsonl", glue_rows(3))
    jsonl(tmp_path / "glue" / "test.jsonl", glue_rows(5))
    data = load("sequence-classification", tmp_path / "glue", tok)
    assert (len(data.train_set), len(data.val_set)) == (8, 3) and "the validation split" in data.description


def test_column_names_from_config(tmp_path, tok):
    rows = [{"question": "hear me", "answer": "speak all", "y": i % 3} for i in range(10)]
    path = jsonl(tmp_path / "qa.jsonl", rows)
    data = load("sequence-classification", path, tok, data__text_columns=["question", "answer"], data__label_column="y")
    assert batch(data.train_set)["token_type_ids"][0].max() == 1 and data.label_names == ["0", "1", "2"]
    with pytest.raises(UserError, match=r"^data.text_columns: 'context' is not a column of .*qa.jsonl'?; columns: question, answer, y$"):
        load("sequence-classification", path, tok, data__text_columns=["question", "context"], data__label_column="y")


def ner_rows(n: int = 10) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        words = list(rng.choice(WORDS, int(rng.integers(2, 6))))
        out.append({"tokens": words, "ner_tags": [["O", "B-PER", "I-PER"][len(w) % 3] for w in words]})
    return out


def test_token_labels_sit_on_each_words_first_sub_word(tmp_path, tok):
    rows = ner_rows()
    data = load("token-classification", jsonl(tmp_path / "conll.jsonl", rows), tok)
    assert data.label_names == ["B-PER", "I-PER", "O"]
    b = batch(data.train_set)
    assert set(b) == {"input_ids", "attention_mask", "labels"} and b["labels"].shape == (9, T)
    core = Tokenizer.from_file(str(tok / "tokenizer.json"))
    for i, row in enumerate(rows[:9]):
        e = core.encode(row["tokens"], is_pretokenized=True)
        firsts = [t for t, w in enumerate(e.word_ids) if w is not None and (t == 0 or e.word_ids[t - 1] != w)]
        assert len(e.ids) > len(row["tokens"]) + 2, "some word splits into sub-words"
        want = np.full(T, IGNORE_INDEX)
        want[firsts] = [data.label_names.index(tag) for tag in row["ner_tags"]]
        assert b["labels"][i].tolist() == want.tolist()  # -100 on later sub-words, [CLS], [SEP] and padding


def test_class_names_of_a_datasets_folder_and_its_validation_split(tmp_path, tok):
    import datasets

    tags = datasets.Sequence(datasets.ClassLabel(names=["O", "B-LOC", "I-LOC"]))
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")), "ner_tags": tags})
    split = lambda rows: datasets.Dataset.from_list(rows, features=features)  # noqa: E731
    train = [{"tokens": ["hear", "me"], "ner_tags": [0, 1]}] * 6
    datasets.DatasetDict({"train": split(train), "validation": split([{"tokens": ["speak"], "ner_tags": [2]}])}).save_to_disk(
        tmp_path / "ds"
    )
    data = load("token-classification", tmp_path / "ds", tok)
    assert data.label_names == ["O", "B-LOC", "I-LOC"], "the ClassLabel's names and order, I-LOC included though training lacks it"
    assert len(data.train_set) == 6 and len(data.val_set) == 1 and batch(data.val_set)["labels"][0, 1] == 2


def test_masks_are_a_function_of_seed_epoch_and_index_only(tmp_path, tok):
    lines = [" ".join(np.random.default_rng(i).choice(WORDS, 12)) for i in range(64)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    data = load("masked-lm", tmp_path / "lines.txt", tok, data__mlm_probability=0.3)
    b = batch(data.train_set)
    ids = data.train_set.arrays["input_ids"]
    chosen = b["labels"] != IGNORE_INDEX
    assert torch.equal(b["labels"][chosen], torch.from_numpy(ids)[chosen]), "labels are the original ids where chosen"
    assert not chosen[data.train_set.special].any(), "never a special token or padding"
    share = chosen.sum() / (~data.train_set.special).sum()
    assert 0.25 < share < 0.35
    masked, kept = (b["input_ids"][chosen] == MASK).float().mean(), (b["input_ids"][chosen] == b["labels"][chosen]).float().mean()
    assert 0.7 < masked < 0.9 and 0.05 < kept < 0.2
    assert torch.equal(b["input_ids"][~chosen], torch.from_numpy(ids)[~chosen])
    # The same sample is masked alike whatever batch it is in (a topology's slice), at every load (a resume).
    again = load("masked-lm", tmp_path / "lines.txt", tok, data__mlm_probability=0.3)
    for key in b:
        assert torch.equal(batch(again.train_set, [5, 3])[key], b[key][[5, 3]])
    other_seed = load("masked-lm", tmp_path / "lines.txt", tok, data__mlm_probability=0.3, train__seed=8)
    assert not torch.equal(batch(other_seed.train_set)["labels"], b["labels"])
    # The train loader gives stream positions (Data.with_epoch): the next epoch masks each sample anew.
    n = len(data.train_set)
    next_epoch = batch(data.train_set, [n + i for i in range(n)])
    assert data.with_epoch and not torch.equal(next_epoch["labels"], b["labels"])
    unchosen = next_epoch["labels"] == IGNORE_INDEX
    assert torch.equal(next_epoch["input_ids"][unchosen], torch.from_numpy(ids)[unchosen]), "the same texts, other masks"
    v1, v2 = (
        next(iter(val_loader(data, config_of(data, tmp_path, tok), 1))),
        next(iter(val_loader(again, config_of(data, tmp_path, tok), 1))),
    )
    assert torch.equal(v1["input_ids"], v2["input_ids"])


def config_of(data, tmp_path, tok):
    return config_from_dict({"model": {"task": "masked-lm", "block_size": T}, "train": {"batch_size": 4, "seed": 7}, "eval": {"iters": 2}})


def test_two_ranks_read_the_batch_one_rank_reads(tmp_path, tok):
    """train_loader's global batch (data/batch_sampler.py) over the masked dict batches: 2 ranks x 2 == 1 x 4."""
    (tmp_path / "lines.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(12)) + "\n")
    data = load("masked-lm", tmp_path / "lines.txt", tok)
    cfg = lambda b: config_from_dict({"model": {"task": "masked-lm"}, "train": {"batch_size": b, "seed": 7}})  # noqa: E731
    one = next(iter(train_loader(data, cfg(4), 1, 0, start_step=3, pin_memory=False)))
    two = [next(iter(train_loader(data, cfg(2), 2, r, start_step=3, pin_memory=False))) for r in (0, 1)]
    for key in one:
        assert torch.equal(one[key], torch.cat([two[0][key], two[1][key]]))
    n = len(data.train_set)  # the second epoch's batch: every sample again, at its position in that epoch
    assert sorted(train_loader(data, cfg(n), 1, 0, 0, False).batch_sampler.indices_at(1)) == [n + i for i in range(n)]


T5 = {"model_type": "t5", "is_encoder_decoder": True}  # what a T5's config.json says of its kind
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"]}


def seq2seq_model(folder: Path, tok: Path, **config) -> Path:
    """A model folder for model.hf_path: the tokenizer and a config.json (no weights: the data reads its config only)."""
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text((tok / "tokenizer.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_seq2seq_labels_and_decoder_inputs_from_each_layout(tmp_path, tok):
    model = seq2seq_model(tmp_path / "t5", tok, **T5, decoder_start_token_id=PAD, pad_token_id=PAD)
    pairs = [{"source": " ".join(WORDS[i:]), "target": " ".join(WORDS[: i + 1])} for i in range(10)]
    layouts = {
        "pairs.jsonl": ({}, pairs),
        "wmt.jsonl": (
            {"data__source_lang": "en", "data__target_lang": "de"},
            [{"translation": {"en": p["source"], "de": p["target"]}} for p in pairs],
        ),
        "xsum.jsonl": ({}, [{"text": p["source"], "summary": p["target"]} for p in pairs]),
    }
    batches = []
    for name, (keys, rows) in layouts.items():
        data = load("seq2seq", jsonl(tmp_path / name, rows), None, model__name="hf", model__hf_path=str(model), **keys)
        batches.append(batch(data.train_set))
    b = batches[0]
    assert set(b) == {"input_ids", "attention_mask", "decoder_input_ids", "labels"} and b["labels"].shape == (9, T)
    for other in batches[1:]:
        assert all(torch.equal(b[k], other[k]) for k in b), "the three layouts of the same texts give the same batch"
    core = Tokenizer.from_file(str(tok / "tokenizer.json"))
    target = core.encode(pairs[2]["target"]).ids
    assert b["labels"][2, : len(target)].tolist() == target and (b["labels"][2, len(target) :] == IGNORE_INDEX).all()
    assert b["decoder_input_ids"][2, 0] == PAD and b["decoder_input_ids"][2, 1 : len(target) + 1].tolist() == target
    assert (b["decoder_input_ids"][2, len(target) + 1 :] == PAD).all()
    assert shift_right(np.array([[5, 6, IGNORE_INDEX]]), 9, 0).tolist() == [[9, 5, 6]]


def test_a_resumed_run_whose_data_has_other_classes_is_refused(tmp_path, tok):
    data = load("sequence-classification", jsonl(tmp_path / "a.jsonl", glue_rows()), tok)
    checkpoint = tmp_path / "step_0000003"
    checkpoint.mkdir()
    (checkpoint / "label_names.json").write_text(data.files["label_names.json"])
    check_same_files(checkpoint, data.files)  # the same classes: resumes
    rows = [{**r, "label": "maybe" if i == 0 else r["label"]} for i, r in enumerate(glue_rows())]
    other = load("sequence-classification", jsonl(tmp_path / "b.jsonl", rows), tok)
    with pytest.raises(
        UserError, match=r"^data.path: the resumed run learned other classes \(2 classes before, 3 now; label id 0 was 'no', is 'maybe'"
    ):
        check_same_files(checkpoint, other.files)


# (task, rows or file text, extra keys, the one line's start)
BAD = [
    (
        "sequence-classification",
        [{"sentence": "a", "label": "x"}, {"sentence": "c", "label": "y"}] * 4
        + [{"sentence": "a", "label": "x"}, {"sentence": "b", "label": "z"}],
        {},
        r"data.path: .*rows.jsonl: row 10 has the label 'z', which no train row has \(train labels: x, y\); the model could never predict it",
    ),
    (
        "sequence-classification",
        [{"text": "a", "score": 1}] * 4,
        {},
        r"data.path: .*rows.jsonl has the columns text, score, none of model.task=sequence-classification's layouts \(sentence1,sentence2,label / sentence,label / text,label\)",
    ),
    (
        "sequence-classification",
        [{"text": "a", "label": 0.5}] * 4,
        {},
        r"data.path: .*rows.jsonl: row 1 has the label 0.5, which is not a class",
    ),
    (
        "sequence-classification",
        [{"text": "a", "label": 1}, {"text": "b", "label": None}] * 2,
        {},
        r"data.path: .*rows.jsonl: row 2 has no 'label'",
    ),
    (
        "sequence-classification",
        [{"text": "a", "label": 1}] * 4,
        {"data__text_columns": ["a", "b", "c"]},
        r"data.text_columns: model.task=sequence-classification reads 1 or 2 text column\(s\), not 3",
    ),
    (
        "sequence-classification",
        [{"text": "a", "label": 1}] * 4,
        {"data__tokenizer": "char"},
        r"model.task=sequence-classification: data.tokenizer=char is built from a corpus",
    ),
    (
        "sequence-classification",
        [{"text": "a", "label": 1}, {"text": "b", "label": 2}] * 2,
        {"model__block_size": 1},
        r"model.block_size=1: the tokenizer cannot encode the rows",
    ),
    (
        "token-classification",
        [{"tokens": ["a", "b"], "ner_tags": ["O"]}] * 4,
        {},
        r"data.path: .*rows.jsonl: row 1 has 2 words \('tokens'\) and 1 labels \('ner_tags'\); give one label per word",
    ),
    (  # issue 34: one class trained to loss 0 and accuracy 1
        "sequence-classification",
        [{"text": "a", "label": "pos"}] * 6,
        {},
        r"data.path: every train row has the label 'pos' in the column 'label': one class, nothing to learn; a classifier needs two or more",
    ),
    (
        "token-classification",
        [{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}] * 6,
        {},
        r"data.path: every train word has the tag 'O' in the column 'ner_tags': one tag, nothing to learn; a tagger needs two or more",
    ),
    ("masked-lm", [{"text": "a"}] * 4, {"data__tokenizer": "{gpt2ish}"}, r"model.task=masked-lm: the tokenizer .* has no mask token"),
    (
        "seq2seq",
        [{"translation": {"en": "a", "de": "b"}}] * 4,
        {"model__name": "hf", "model__hf_path": "{t5}"},
        r"data.source_lang and data.target_lang: name the languages of the 'translation' column .*\(its first row has en, de\)",
    ),
    (
        "seq2seq",
        [{"source": "a", "target": "b"}] * 4,
        {"model__name": "hf", "model__hf_path": "{no_start}"},
        r"model.hf_path: .*'s config.json has no decoder_start_token_id",
    ),
    ("seq2seq", [{"source": "a", "target": "b"}] * 4, {}, r"model.task=seq2seq: the decoder's first input .* model.name=gpt has none"),
    *[  # issue 34: a BERT asked for a decoder_start_token_id, and failed another way once given one
        (
            "seq2seq",
            [{"source": "a", "target": "b"}] * 4,
            {"model__name": "hf", "model__hf_path": "{" + bert + "}"},
            r"model.task=seq2seq: model.hf_path '.*' is a bert, not an encoder-decoder .*: seq2seq needs one, such as T5 or BART; "
            r"a bert serves model.task=sequence-classification, token-classification or masked-lm$",
        )
        for bert in ("bert", "bert_with_start")
    ],
    (
        "sequence-classification",
        "",
        {"data__format": "chat"},
        r"data.format=chat: model.task=sequence-classification reads rows of its own columns",
    ),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory, tok) -> dict[str, Path]:
    """What the bad cases name: a seq2seq model folder, one without decoder_start_token_id, BERTs (encoders) with and
    without one, a BPE without a mask token."""
    tmp = tmp_path_factory.mktemp("places")
    hf_tiny.train_tokenizer().backend_tokenizer.save(str(tmp / "bpe.json"))
    return {
        "t5": seq2seq_model(tmp / "t5", tok, **T5, decoder_start_token_id=0),
        "no_start": seq2seq_model(tmp / "no_start", tok, **T5),
        "bert": seq2seq_model(tmp / "bert", tok, **BERT),
        "bert_with_start": seq2seq_model(tmp / "bert_with_start", tok, **BERT, decoder_start_token_id=0),
        "gpt2ish": tmp / "bpe.json",
    }


@pytest.mark.parametrize("task, rows, keys, expected", BAD, ids=[f"{t}-{i}" for i, (t, *_) in enumerate(BAD)])
def test_bad_task_data_is_one_line(tmp_path, tok, places, task, rows, keys, expected):
    keys = {k: v.format(**places) if isinstance(v, str) else v for k, v in keys.items()}
    path = jsonl(tmp_path / "rows.jsonl", rows) if rows else tmp_path / "rows.jsonl"
    with pytest.raises(UserError) as e:
        load(task, path, keys.pop("data__tokenizer", tok), **keys)
    assert "\n" not in str(e.value) and re.match(expected, str(e.value)), str(e.value)


def test_blank_lines_of_a_text_file_are_dropped_as_run_mlm_drops_them(tmp_path, tok):
    """masked-lm, line by line: an empty or whitespace-only line is no sample (nothing to learn), in train and in
    validation rows alike; the banner says how many went. Only blank lines: one line."""
    lines = ["hear me speak", "", "   ", "first citizen", "\t", "speak all", "", "we proceed"]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    data = load("masked-lm", tmp_path / "lines.txt", tok, data__val_fraction=0.25)  # the last 2 lines: "", "we proceed"
    assert (len(data.train_set), len(data.val_set)) == (3, 1)
    assert (batch(data.train_set)["attention_mask"].sum(dim=1) > 2).all(), "every sample holds more than [CLS] [SEP]"
    assert "4 blank rows dropped" in data.description
    (tmp_path / "blank.txt").write_text("\n \n\n\n")
    with pytest.raises(UserError, match="every train row's 'text' is blank"):
        load("masked-lm", tmp_path / "blank.txt", tok)


def cut_and_fixed(dataset, groups: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """The batches of `groups` as a run without a fixed shape reads them (each cut to its longest), and at block_size."""
    assert not dataset.fixed, "the default layout (no pipeline, tp or compile) cuts each batch"
    cut = [dataset.__getitems__(g) for g in groups]
    dataset.fixed = True
    fixed = [dataset.__getitems__(g) for g in groups]
    dataset.fixed = False
    return cut, fixed


PADDED_TASKS = {  # model.task -> its rows, of several lengths
    "sequence-classification": lambda: [
        {"sentence1": " ".join(WORDS[: 1 + i % 3]), "sentence2": " ".join(WORDS[3 : 4 + i % 3]), "label": ["no", "yes"][i % 2]}
        for i in range(16)
    ],
    "token-classification": lambda: ner_rows(16),
    "masked-lm": lambda: [{"text": " ".join(WORDS[: 1 + i % 5])} for i in range(16)],
    "seq2seq": lambda: [{"source": " ".join(WORDS[i % 5 : 2 + i % 7]), "target": " ".join(WORDS[: 1 + i % 4])} for i in range(16)],
}


@pytest.mark.parametrize("task", list(PADDED_TASKS))
def test_batches_cut_to_their_longest_train_exactly_as_batches_of_block_size(tmp_path, tok, task):
    """Each batch padded to its longest row (a multiple of 8), as the scripts' collators pad, is what the fixed
    block_size batch holds less padding alone: the same losses and the same weights after 3 SGD steps of a tiny
    transformers model, and fewer positions. A seq2seq's targets are cut to their own longest."""
    from parallel_train.eval_metrics import per_sample_losses
    from parallel_train.losses import token_losses
    from parallel_train.models.hf import HFConfig, HFModel

    config = hf_tiny.t5_config() if task == "seq2seq" else hf_tiny.bert_config()
    auto = {"seq2seq": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM"}.get(task, "AutoModel")
    folder = hf_tiny.save_task_model(config, auto, tmp_path / "model")
    data = load(task, jsonl(tmp_path / "rows.jsonl", PADDED_TASKS[task]()), tok, model__name="hf", model__hf_path=str(folder))
    assert "padded to each batch's longest (a multiple of 8, at most model.block_size=24)" in data.description
    order = np.argsort(data.train_set.real, kind="stable").tolist()  # batches of short, middling and long rows
    cut, fixed = cut_and_fixed(data.train_set, [order[:4], order[4:9], order[9:]])
    widths = [b["input_ids"].shape[1] for b in cut]
    assert all(w % 8 == 0 and w <= T for w in widths) and min(widths) < T, widths
    for c, f in zip(cut, fixed, strict=True):
        for key, value in f.items():  # what was cut is padding: no token, no label
            assert torch.equal(c[key], value[..., : c[key].shape[-1]])
            assert value.dim() == 1 or (value[:, c[key].shape[1] :] == (IGNORE_INDEX if key == "labels" else PAD)).all()
    torch.manual_seed(0)
    cfg = HFConfig(name="hf", hf_path=str(folder), block_size=T, task=task)
    first = HFModel(cfg, hf_tiny.VOCAB, data.label_names)
    losses = {}
    for name, batches in (("cut", cut), ("fixed", fixed)):
        model = HFModel(cfg, hf_tiny.VOCAB, data.label_names)
        model.load_state_dict(first.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD: Adam would blow float noise up into full steps
        losses[name] = []
        for b in batches:
            logits = model(b["input_ids"], **{k: v for k, v in b.items() if k not in ("input_ids", "labels")})
            summed, count = per_sample_losses(token_losses(logits, b["labels"]), b["labels"]).sum(dim=0)
            (summed / count).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append((summed / count).item())
        losses[name + " weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert losses["cut"] == pytest.approx(losses["fixed"], rel=1e-5)
    for key, value in losses["fixed weights"].items():
        torch.testing.assert_close(losses["cut weights"][key], value, rtol=1e-4, atol=1e-5)


def test_layouts_that_need_one_shape_keep_block_size_and_the_banner_says_which(tmp_path, tok):
    """Pipeline stages, tensor parallel and torch.compile keep every batch model.block_size long; elsewhere the memory
    estimate's widest sample (data/batch.py) is the widest batch's width, each key its own (a seq2seq's targets)."""
    from parallel_train.data.batch import widest_sample
    from parallel_train.tasks.text_rows import fixed_shapes

    path = jsonl(tmp_path / "rows.jsonl", PADDED_TASKS["masked-lm"]())
    data = load("masked-lm", path, tok, train__compile=True)
    assert data.train_set.fixed and data.val_set.fixed and "padded to model.block_size=24 (torch.compile: one shape)" in data.description
    assert batch(data.train_set, [0])["input_ids"].shape == (1, T)
    cfg = lambda **p: config_from_dict({"parallel": p})  # noqa: E731
    assert (fixed_shapes(cfg()), fixed_shapes(cfg(tp=2)), fixed_shapes(cfg(pipeline_stages=2))) == (
        None,
        "tensor parallel",
        "pipeline stages",
    )
    widest = widest_sample(load("masked-lm", path, tok).train_set)
    assert widest["input_ids"].shape == widest["labels"].shape == (-(-int(max(data.train_set.real)) // 8) * 8,)
