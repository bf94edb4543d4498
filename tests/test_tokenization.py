"""Tokenizers: every kind behind one interface, saved and loaded back, and one-line errors for bad specs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parallel_train.data.tokenizers import (
    ByteVocab,
    CharVocab,
    HFTokenizer,
    check_spec,
    load_saved,
    load_tokenizer,
    train_bpe,
)
from parallel_train.errors import UserError

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 30


def corpus():
    return [TEXT.splitlines(keepends=True)]


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer("bpe:300", corpus=corpus)


def test_every_kind_round_trips_and_saves(tmp_path, bpe):
    for tok in (load_tokenizer("char", corpus=corpus), load_tokenizer("byte"), bpe):
        ids = tok.encode(TEXT)
        assert ids.dtype == np.int64 and ids.max() < tok.size and tok.decode(ids.tolist()) == TEXT
        folder = tmp_path / tok.kind
        folder.mkdir()
        tok.save(folder)
        again = load_saved(folder)
        assert type(again) is type(tok) and again.fingerprint == tok.fingerprint
        assert np.array_equal(again.encode(TEXT), ids)
        assert load_tokenizer(str(folder)).fingerprint == tok.fingerprint  # a folder is a spec too
    assert bpe.size == 300 and bpe.eot is not None and len(bpe.encode(TEXT)) < len(TEXT) / 2
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tokenizer.json"]
    assert sorted(p.name for p in (tmp_path / "char").iterdir()) == ["vocab.json"]


def test_the_word_tokenizer_is_a_tokenizer_json_of_whitespace_separated_words_and_line_ends(tmp_path):
    """data.tokenizer=word (pytorch/examples' word_language_model): one id per word, <eos> at every line end (and as
    the end of a document), <unk> for a word it never saw; saved as a plain tokenizer.json that reloads alike."""
    word = load_tokenizer("word", corpus=corpus)
    ids = word.encode(TEXT)
    core = word.tokenizer
    assert [core.id_to_token(i) for i in ids[:10]] == ["To", "be,", "or", "not", "to", "be,", "that", "is", "the", "question:"]
    assert core.id_to_token(int(ids[10])) == "<eos>" == core.id_to_token(word.eot)
    assert word.decode(ids.tolist()) == TEXT and word.size == len(set(TEXT.split())) + 2  # the words, <unk>, <eos>
    assert word.decode(word.encode("to be or  not\n\nthe zounds").tolist()) == "to <unk> or not\n\nthe <unk>"
    word.save(tmp_path)
    again = load_saved(tmp_path)
    assert isinstance(again, HFTokenizer) and again.fingerprint == word.fingerprint and np.array_equal(again.encode(TEXT), ids)
    assert load_tokenizer("word", corpus=lambda: [TEXT.splitlines(keepends=True)]).fingerprint == word.fingerprint  # any batching
    with pytest.raises(UserError, match="built from a corpus"):
        load_tokenizer("word")


def test_bpe_training_is_deterministic():
    a, b = train_bpe(iter(corpus()), 280), train_bpe(iter(corpus()), 280)
    assert a.fingerprint == b.fingerprint


def test_a_tokenizer_json_file_or_model_folder_loads(tmp_path, bpe):
    """What an AutoTokenizer-style folder holds: tokenizer.json (plus files we do not need)."""
    model = tmp_path / "model"
    model.mkdir()
    bpe.save(model)
    (model / "config.json").write_text("{}")
    for spec in (str(model), str(model / "tokenizer.json")):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer) and tok.encode("to be").tolist() == bpe.encode("to be").tolist()


def test_old_runs_vocab_json_still_loads(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"kind": "char", "chars": ["a", "b"]}))
    assert load_saved(tmp_path) == CharVocab(["a", "b"])
    (tmp_path / "vocab.json").write_text(json.dumps({"kind": "byte"}))
    assert isinstance(load_saved(tmp_path), ByteVocab)
    assert load_saved(tmp_path / "nothing_here") is None


def test_padded_ids_decode_to_nothing(bpe):
    assert load_tokenizer("byte").decode([104, 105, 300]) == "hi"
    assert bpe.decode(bpe.encode("to be").tolist() + [bpe.size + 5]) == "to be"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("wordpiece:100", "unknown tokenizer kind 'wordpiece'"),
        ("bpe:100", "bpe:N with N in \\[257"),
        ("bpe", "bpe:N with N in \\[257"),
        ("bpe:abc", "bpe:N with N in \\[257"),
        ("", "must not be empty"),
    ],
)
def test_malformed_specs_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message):
        check_spec(spec)


def test_what_cannot_be_loaded_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying for 25 s
    with pytest.raises(UserError, match="built from a corpus"):
        load_tokenizer("char")
    with pytest.raises(UserError, match="no tokenizer.json or vocab.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable tokenizer.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="could be loaded"):
        load_tokenizer("no-such-org/no-such-tokenizer-xyz")


def test_the_in_memory_corpus_takes_every_kind_and_keeps_a_resumed_runs(tmp_path, bpe):
    from parallel_train.config.sections import Config
    from parallel_train.data.text import build_datasets

    (tmp_path / "c.txt").write_text(TEXT)
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer, cfg.model.block_size = str(tmp_path / "c.txt"), "bpe:300", 8
    data = build_datasets(cfg)
    assert isinstance(data.vocab, HFTokenizer) and data.vocab.size == data.vocab_size == 300
    assert build_datasets(cfg, bpe).vocab is bpe  # a resumed run keeps its ids
    with pytest.raises(UserError, match="the resumed run used the char tokenizer; resume with data.tokenizer=char"):
        build_datasets(cfg, CharVocab.from_text(TEXT))
    cfg.data.tokenizer = "char"
    with pytest.raises(UserError, match="resume with data.tokenizer=the bpe:N, word or tokenizer.json it was started with"):
        build_datasets(cfg, bpe)


def test_a_tokenizer_json_whose_unk_token_is_missing_is_refused_when_loaded(tmp_path):
    """tokenizers itself raises only when it meets an unknown word, mid-data, as a bare Exception."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"to": 0, "be": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError) as e:
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert str(e.value) == (
        f"tokenizer {tmp_path / 'tokenizer.json'}: its unk token '[UNK]' is not in its vocabulary; "
        "add it to model.vocab in the file, or remove unk_token"
    )
    with pytest.raises(UserError, match="its unk token"):
        load_tokenizer(str(tmp_path))  # the folder that holds it


def test_a_vocabulary_with_gaps_in_its_ids_sizes_the_model_by_its_largest_id(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"to": 0, "[UNK]": 1, "be": 9}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("to be or").tolist() == [0, 9, 1] and tokenizer.size == 10
