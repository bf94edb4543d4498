"""Data: loading through `datasets`, vocabulary, 90/10 split, and sharding of the global batch."""

from __future__ import annotations

import json

import pytest
import torch

from parallel_train.config.sections import Config
from parallel_train.data.batch_sampler import GlobalBatchSampler
from parallel_train.data.text import build_datasets, load_corpus, val_loader
from parallel_train.data.tokenizers import CharVocab
from parallel_train.errors import UserError


def small_cfg(path, **train) -> Config:
    cfg = Config()
    cfg.data.path = str(path)
    cfg.model.block_size = 8
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_default_corpus_split_and_vocab():
    cfg = Config()
    data = build_datasets(cfg)
    assert data.vocab.size == 65 and data.vocab.chars == sorted(data.vocab.chars)
    n_train, n_val = len(data.train_set.ids), len(data.val_set.ids)
    assert n_train + n_val == 1_115_394
    assert n_val == int(1_115_394 * 0.1)  # the last 10% is validation, as in the published baselines
    x, y = data.train_set[0]
    assert x.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert data.vocab.decode(x[:14].tolist()) == "First Citizen:"


def test_vocab_roundtrip():
    vocab = CharVocab.from_text("hello world!")
    assert vocab.decode(vocab.encode("world hello").tolist()) == "world hello"
    assert CharVocab(**{k: v for k, v in json.loads(vocab.to_json()).items() if k == "chars"}) == vocab


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_structured_files_through_datasets(tmp_path, fmt):
    import datasets

    rows = [{"text": "to be or not to be " * 5}, {"text": "that is the question " * 5}]
    path = tmp_path / f"corpus.{fmt if fmt != 'json' else 'jsonl'}"
    ds = datasets.Dataset.from_list(rows)
    {"json": ds.to_json, "csv": ds.to_csv, "parquet": ds.to_parquet}[fmt](str(path))
    text = load_corpus(small_cfg(path).data)
    assert text == rows[0]["text"] + "\n" + rows[1]["text"]


def test_missing_column_and_missing_file(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "abc"}) + "\n")
    cfg = small_cfg(path)
    cfg.data.text_column = "content"
    with pytest.raises(UserError, match="data.text_column: 'content' is not a column"):
        load_corpus(cfg.data)
    with pytest.raises(UserError, match="no such file"):
        load_corpus(small_cfg(tmp_path / "missing.txt").data)


def test_a_folder_of_several_kinds_reads_every_data_file_and_refuses_others(tmp_path):
    """The rule of scripts/prepare_data.py: text files as one text, rows of the others as documents, the dataset card
    left out and named; a file of a kind no reader takes is a one-line error, never skipped in silence."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("first text file\n")
    (folder / "b.txt").write_text("second text file\n")
    (folder / "rows.jsonl").write_text(json.dumps({"text": "row one"}) + "\n" + json.dumps({"text": "row two"}) + "\n")
    (folder / "README.md").write_text("# the dataset card\n")
    cfg = small_cfg(folder)
    cfg.data.val_fraction = 0.3
    data = build_datasets(cfg)
    text = data.vocab.decode(torch.cat([data.train_set.ids, data.val_set.ids]).tolist())
    assert text == "first text file\nsecond text file\n\nrow one\nrow two"
    assert data.description == (
        f"{folder}: read 2 text files (a.txt, b.txt) as one text; 1 json file (rows.jsonl) as documents; "
        "skipped README.md (not data files of the train split)"
    )
    for name in ("shards.bin", "notes.md"):
        (folder / name).write_bytes(b"\x00\x01")
        with pytest.raises(UserError) as e:
            load_corpus(cfg.data)
        assert (
            str(e.value) == f"data.path={folder}: {folder / name} is not a .txt/.jsonl/.json/.csv/.parquet file; move it out of the folder"
        )
        (folder / name).unlink()


def test_too_short_corpus(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abcdefghij" * 3)
    with pytest.raises(UserError, match="too short"):
        build_datasets(small_cfg(path))


def global_batches(n, batch, world, accum, steps, seed=0):
    """samples[step] = list over (micro-step, rank) of index lists."""
    samplers = [GlobalBatchSampler(n, batch, world, r, seed) for r in range(world)]
    out = []
    for step in range(steps):
        pieces = [samplers[r].indices_at(step * accum + j) for j in range(accum) for r in range(world)]
        out.append(pieces)
    return out


def test_ranks_see_disjoint_shards_whose_union_is_the_global_batch():
    one = global_batches(n=100, batch=8, world=1, accum=1, steps=30)
    two = global_batches(n=100, batch=4, world=2, accum=1, steps=30)
    acc = global_batches(n=100, batch=2, world=1, accum=4, steps=30)
    mixed = global_batches(n=100, batch=2, world=2, accum=2, steps=30)
    for step in range(30):
        full = sorted(one[step][0])
        a, b = two[step]
        assert not set(a) & set(b), "ranks overlap"
        assert sorted(a + b) == full
        assert sorted(sum(acc[step], [])) == full
        assert sorted(sum(mixed[step], [])) == full


def test_epochs_cover_every_sample_once_and_reshuffle():
    batches = global_batches(n=12, batch=3, world=2, accum=1, steps=6)  # 6 samples per step: 2 steps per epoch
    epoch0 = sorted(sum(batches[0] + batches[1], []))
    epoch1 = sorted(sum(batches[2] + batches[3], []))
    assert epoch0 == epoch1 == list(range(12))
    assert sum(batches[0] + batches[1], []) != sum(batches[2] + batches[3], [])
    straddle = global_batches(n=10, batch=4, world=1, accum=1, steps=5)  # batches cross epoch boundaries
    assert all(len(b[0]) == 4 for b in straddle)


def test_resume_position_needs_only_the_step():
    fresh = GlobalBatchSampler(1000, 4, 2, 1, seed=3)
    resumed = GlobalBatchSampler(1000, 4, 2, 1, seed=3, start_micro_step=7)
    it = iter(resumed)
    assert [next(it) for _ in range(3)] == [fresh.indices_at(m) for m in (7, 8, 9)]


def test_val_set_is_fixed():
    cfg = Config()
    cfg.eval.iters = 3
    data = build_datasets(cfg)
    first = [torch.cat([x.flatten() for x, _ in val_loader(data, cfg, 1)])]
    again = [torch.cat([x.flatten() for x, _ in val_loader(data, cfg, 1)])]
    assert torch.equal(first[0], again[0]) and first[0].numel() == 3 * 12 * 64


def test_eval_iters_0_scores_the_whole_validation_split_once_in_order():
    """A task's validation set is scored whole: every window once, in order, the last batch short."""
    cfg = Config()
    cfg.eval.iters, cfg.eval.batch_size = 0, 5
    data = build_datasets(cfg)
    batches = list(val_loader(data, cfg, 2))
    seen = torch.cat([x for x, _ in batches])
    assert len(seen) == len(data.val_set) and len(batches) == -(-len(data.val_set) // 5)
    assert torch.equal(seen, torch.stack([data.val_set[i][0] for i in range(len(data.val_set))]))
