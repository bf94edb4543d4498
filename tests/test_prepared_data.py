"""Prepared data and streams, in process: prepare_data's output, idempotence, kill safety, every bad input, the
memory-mapped windows, the O(1)-memory order, and a stream's resumable position."""

from __future__ import annotations

import json
import re
import shutil

import datasets
import numpy as np
import pytest
import torch

from helpers import REPO, launch_env, run, warm_script
from parallel_train.config.sections import Config
from parallel_train.data import inputs
from parallel_train.data.batch_sampler import GlobalBatchSampler
from parallel_train.data.permutation import SeededPermutation
from parallel_train.data.prepare import Options, prepare
from parallel_train.data.prepared import META, PreparedWindows, TokenShards, read_meta
from parallel_train.data.sources import load_data
from parallel_train.data.tokenizers import CharVocab, load_tokenizer
from parallel_train.errors import UserError

datasets.disable_progress_bars()
SHAKESPEARE = (REPO / "data" / "tinyshakespeare.txt").read_text()[:60_000]


def prep(out, inputs, tokenizer="char", **kw):
    return prepare(Options([str(i) for i in inputs], out, tokenizer, num_proc=kw.pop("num_proc", 1), **kw), print_fn=lambda m: None)


def cfg_for(path, block_size=8, **data) -> Config:
    cfg = Config()
    cfg.data.path, cfg.model.block_size = str(path), block_size
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    (tmp / "play.txt").write_text(SHAKESPEARE)
    return tmp / "play.txt"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("prepared") / "char"
    prep(out, [corpus], shard_tokens=7_000)  # several shards: windows cross their edges
    return out


# ---------------------------------------------------------------- preparing


def test_char_shards_hold_the_same_ids_as_the_in_memory_path(prepared):
    meta, _ = read_meta(prepared)
    ids = CharVocab.from_text(SHAKESPEARE).encode(SHAKESPEARE)
    train = np.concatenate([np.fromfile(prepared / s["file"], dtype="<u2") for s in meta["splits"]["train"]["shards"]])
    val = np.concatenate([np.fromfile(prepared / s["file"], dtype="<u2") for s in meta["splits"]["val"]["shards"]])
    assert len(val) == int(len(ids) * 0.1) and np.array_equal(np.concatenate([train, val]), ids)  # the last 10% validates
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == len(set(SHAKESPEARE))
    assert len(meta["splits"]["train"]["shards"]) == 8 and meta["splits"]["train"]["chars"] == len(train)
    assert sorted(p.name for p in prepared.iterdir() if not p.name.endswith(".bin")) == [META, "vocab.json"]


def test_windows_are_read_across_shards_without_loading_them(prepared):
    meta, _ = read_meta(prepared)
    tokens = TokenShards(prepared, meta["splits"]["train"]["shards"], meta["dtype"])
    flat = np.concatenate([np.fromfile(prepared / s["file"], dtype="<u2") for s in meta["splits"]["train"]["shards"]])
    windows = PreparedWindows(tokens, 64)
    assert len(windows) == (len(flat) - 1) // 64
    crossing = 7_000 // 64  # window 109 spans shards 0 and 1
    x, y = windows.__getitems__([0, crossing, len(windows) - 1])
    for row, i in enumerate([0, crossing, len(windows) - 1]):
        assert torch.equal(x[row], torch.from_numpy(flat[i * 64 : i * 64 + 64].astype(np.int64)))
        assert torch.equal(y[row], torch.from_numpy(flat[i * 64 + 1 : i * 64 + 65].astype(np.int64)))
    assert all(isinstance(m.base, np.memmap) for m in tokens._maps)  # views of memory maps: nothing was read whole


def test_the_same_inputs_a_second_time_do_nothing(tmp_path, corpus):
    out = tmp_path / "out"
    prep(out, [corpus])
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    lines = []
    assert prepare(Options([str(corpus)], out, "char"), print_fn=lines.append) is None
    assert lines[0].startswith(f"up to date: {out} already holds these inputs") and before == {
        p.name: p.stat().st_mtime_ns for p in out.iterdir()
    }
    with pytest.raises(UserError, match="holds data prepared from other inputs or options; choose another --output or pass --overwrite"):
        prep(out, [corpus], tokenizer="byte")
    prep(out, [corpus], tokenizer="byte", overwrite=True)
    assert read_meta(out)[0]["tokenizer"]["spec"] == "byte" and read_meta(out)[0]["splits"]["train"]["tokens"] > 0


@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe:300"])
def test_a_file_without_line_breaks_is_read_in_bounded_pieces_with_the_same_ids(tmp_path, monkeypatch, tokenizer):
    """A line longer than PIECE_CHARS is cut into rows of at most that many characters (memory flat in line length):
    char and byte ids are exactly those of the whole text, even where a stretch without a space is cut at the limit;
    a BPE's too where every cut falls before a space (docs/data.md says what a cut elsewhere does)."""
    monkeypatch.setattr(inputs, "PIECE_CHARS", 64)
    text = SHAKESPEARE[:20_000].replace("\n", " ") + "\u00e9\u00e8 " * 40  # multi-byte characters too
    if tokenizer != "bpe:300":
        text += "x" * 200  # no space: cut at the limit
    (tmp_path / "one_line.txt").write_text(text)
    rows = inputs.load_source(inputs.resolve_inputs([str(tmp_path / "one_line.txt")])[0], "text", tmp_path / "cache")["text"]
    assert "".join(rows) == text and max(map(len, rows)) <= 64 and len(rows) > len(text) / 64
    assert sum(len(r) <= 32 for r in rows) <= 1  # cut in the second half of a piece (only the last may be shorter)
    meta = prep(tmp_path / "out", [tmp_path / "one_line.txt"], tokenizer=tokenizer, val_fraction=0.5)
    shards = [tmp_path / "out" / s["file"] for split in ("train", "val") for s in meta["splits"][split]["shards"]]
    ids = np.concatenate([np.fromfile(f, dtype=meta["dtype"]) for f in shards])
    assert ids.tolist() == load_tokenizer(tmp_path / "out").encode(text).tolist()


def test_documents_of_every_format_end_with_the_end_of_text_token(tmp_path):
    rows = [{"body": f"document {i}: " + "to be or not to be. " * (i + 1)} for i in range(30)]
    ds = datasets.Dataset.from_list(rows)
    folder = tmp_path / "folder"
    folder.mkdir()
    ds.select(range(10)).to_json(str(tmp_path / "a.jsonl"))
    ds.select(range(10, 20)).to_csv(str(tmp_path / "b.csv"))
    ds.select(range(20, 30)).to_parquet(str(folder / "train-00000.parquet"))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    load_tokenizer("bpe:300", corpus=lambda: [[r["body"] for r in rows]]).save(tok_dir)
    out = tmp_path / "out"
    meta = prep(out, [tmp_path / "*.jsonl", tmp_path / "b.csv", folder], tokenizer=str(tok_dir / "tokenizer.json"), text_column="body")
    tok = load_tokenizer(str(out))
    expected = np.concatenate([np.append(tok.encode(r["body"]), tok.eot) for r in rows])
    got = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for split in ("train", "val") for s in meta["splits"][split]["shards"]])
    assert np.array_equal(got, expected) and meta["tokenizer"]["eot"] == tok.eot


BAD_PREPARE = [
    ("empty", lambda t: t.joinpath("e.txt").write_text(""), ["e.txt"], "e.txt is empty"),
    ("not_text", lambda t: t.joinpath("b.txt").write_bytes(bytes(range(256)) * 64), ["b.txt"], "is not UTF-8 text (a binary file?)"),
    ("nul_bytes", lambda t: t.joinpath("n.txt").write_text("abc\x00def\n" * 10), ["n.txt"], "contains NUL bytes"),
    ("no_column", lambda t: t.joinpath("r.jsonl").write_text('{"body": "x"}\n'), ["r.jsonl"], "--text_column: 'text' is not a column"),
    ("missing", lambda t: None, ["nope.txt"], "nope.txt: no such file or folder"),
    ("no_match", lambda t: None, ["*.jsonl"], "no file matches"),
    ("other_format", lambda t: t.joinpath("x.docx").write_text("x"), ["x.docx"], "is not a .txt/.jsonl/.json/.csv/.parquet file"),
]


@pytest.mark.parametrize("make, inputs, message", [pytest.param(m, i, e, id=n) for n, m, i, e in BAD_PREPARE])
def test_bad_inputs_to_prepare_write_nothing(tmp_path, make, inputs, message):
    make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=re.escape(message)):
        prep(out, [tmp_path / i for i in inputs])
    assert not (out / META).exists()


def test_a_folder_that_is_not_ours_is_never_written_into(tmp_path, corpus):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="is not empty and holds no prepared data"):
        prep(out, [corpus])
    assert [p.name for p in out.iterdir()] == ["notes.md"]


def test_prepare_script_says_one_line_and_exits_2(tmp_path):
    (tmp_path / "b.txt").write_bytes(bytes(range(256)) * 64)
    r = run(
        warm_script("scripts/prepare_data.py", "--input", str(tmp_path / "b.txt"), "--output", str(tmp_path / "o"), "--tokenizer", "byte")
    )
    assert r.returncode == 2 and "Traceback" not in r.output
    assert [line for line in r.output.splitlines() if line.startswith("error:")] == [
        f"error: --input {tmp_path / 'b.txt'}: {tmp_path / 'b.txt'} is not UTF-8 text (a binary file?)"
    ]


def test_a_kill_while_preparing_leaves_nothing_that_looks_complete(tmp_path, corpus):
    """SIGKILL after the first shard, replacing a complete dataset: the old one is no longer a dataset, and
    training says so; running again finishes."""
    out = tmp_path / "out"
    prep(out, [corpus])
    args = ("--input", str(corpus), "--output", str(out), "--tokenizer", "byte")  # forked warm: a real process, SIGKILLed
    killed = run(
        warm_script("scripts/prepare_data.py", *args, "--overwrite", "--shard_tokens", "5000", "--num_proc", "1"),
        env=launch_env(PARALLEL_TRAIN_FAULT="kill_in_prepare@1"),
    )
    assert killed.returncode == -9 and (out / "train_000000.bin").exists() and not (out / META).exists()
    with pytest.raises(UserError, match="has no prepared.json"):
        load_data(cfg_for(out))
    done = run(warm_script("scripts/prepare_data.py", *args, "--overwrite", "--num_proc", "1"))
    assert done.returncode == 0, done.output
    assert read_meta(out)[0]["tokenizer"]["spec"] == "byte" and not list(out.glob("*.tmp")) and not (out / ".prepare-work").exists()
    assert len(load_data(cfg_for(out)).train_set) > 0


# ---------------------------------------------------------------- training on it: bad inputs


def damaged(tmp_path, prepared, damage):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    damage(copy)
    return copy


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))


BAD_PREPARED = [
    ("truncated", lambda c: c.joinpath("train_000001.bin").write_bytes(c.joinpath("train_000001.bin").read_bytes()[:-2]), "train_000001.bin is 13,998 bytes, prepared.json says 14,000"),
    ("missing", lambda c: c.joinpath("val_000000.bin").unlink(), "val_000000.bin is missing (prepared.json lists it)"),
    ("same_size_other_content", lambda c: flip_byte(c / "train_000002.bin"), "train_000002.bin does not match prepared.json (its sha256 differs"),
    ("malformed_meta", lambda c: c.joinpath(META).write_text('{"format": 1}'), "is not a valid parallel-train prepared tokens file"),
    ("meta_not_json", lambda c: c.joinpath(META).write_text("{"), "prepared.json is not readable JSON"),
    ("other_tokenizer", lambda c: c.joinpath("vocab.json").write_text(json.dumps({"kind": "byte"})), "vocab.json does not match prepared.json"),
]  # fmt: skip


@pytest.mark.parametrize("damage, message", [pytest.param(d, m, id=n) for n, d, m in BAD_PREPARED])
def test_damaged_prepared_data_is_refused_in_one_line(tmp_path, prepared, damage, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        load_data(cfg_for(damaged(tmp_path, prepared, damage)))
    assert "\n" not in str(e.value)


def swap_in_a_smaller_vocabulary(copy):
    """A tokenizer of 20 characters in place of the preparation's, prepared.json edited to match: the shards hold ids beyond it."""
    small = CharVocab(CharVocab.load(copy / "vocab.json").chars[:20])
    small.save(copy)
    meta = json.loads((copy / META).read_text())
    meta["tokenizer"].update(fingerprint=small.fingerprint, vocab_size=small.size)
    (copy / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("verify", ["size", "full"])
def test_token_ids_beyond_the_vocabulary_are_refused_in_one_line(tmp_path, prepared, verify):
    """The largest id of each shard is recorded when it is written, and checked against the tokenizer's vocabulary:
    from prepared.json always, from the shards themselves when they are hashed (an IndexError in the embedding before)."""
    meta, _ = read_meta(prepared)
    tops = [s["max_id"] for split in ("train", "val") for s in meta["splits"][split]["shards"]]
    assert max(tops) == meta["tokenizer"]["vocab_size"] - 1 == 58
    copy = damaged(tmp_path, prepared, swap_in_a_smaller_vocabulary)
    with pytest.raises(UserError, match=r"train_000000.bin holds token id \d+, beyond the 20 ids of the tokenizer next to it"):
        load_data(cfg_for(copy, verify=verify))
    if verify == "full":  # an edited record is not trusted when the shards are read: these ids are the real ones
        meta = json.loads((copy / META).read_text())
        for shard in meta["splits"]["train"]["shards"]:
            shard["max_id"] = 0
        (copy / META).write_text(json.dumps(meta))
        with pytest.raises(UserError, match="holds token id"):
            load_data(cfg_for(copy, verify="full"))


def test_size_checks_only_when_told(tmp_path, prepared):
    copy = damaged(tmp_path, prepared, lambda c: flip_byte(c / "train_000002.bin"))
    assert len(load_data(cfg_for(copy, verify="size")).train_set) > 0


def test_vocabulary_larger_than_the_model_and_another_tokenizer_on_resume(prepared):
    cfg = cfg_for(prepared)
    cfg.model.vocab_size = 50
    with pytest.raises(UserError, match="model.vocab_size=50 is smaller than the tokenizer's 59 ids"):
        load_data(cfg)
    cfg.model.vocab_size = 128
    assert load_data(cfg).vocab_size == 128
    with pytest.raises(UserError, match="the resumed run was trained with another tokenizer"):
        load_data(cfg_for(prepared), load_tokenizer("byte"))


# ---------------------------------------------------------------- order without a stored permutation


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4099])
def test_seeded_permutation_is_a_permutation_per_epoch(n):
    p = SeededPermutation(n, seed=5)
    first, second = p.take(0, 0, n), p.take(1, 0, n)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))
    assert n < 4 or first.tolist() != second.tolist()
    assert np.array_equal(p.take(0, n // 2, n - n // 2), first[n // 2 :])  # any position, on its own
    assert np.array_equal(SeededPermutation(n, seed=5).take(0, 0, n), first)


def test_seeded_order_gives_every_topology_the_same_global_batch():
    def pieces(batch, world, accum, step):
        samplers = [GlobalBatchSampler(500, batch, world, r, seed=1, order="seeded") for r in range(world)]
        return sorted(i for j in range(accum) for r in range(world) for i in samplers[r].indices_at(step * accum + j))

    for step in (0, 7, 80):  # step 80 crosses into the third epoch
        assert pieces(8, 1, 1, step) == pieces(4, 2, 1, step) == pieces(2, 1, 4, step) == pieces(2, 2, 2, step)
    resumed = iter(GlobalBatchSampler(500, 4, 2, 1, seed=1, start_micro_step=9, order="seeded"))
    assert next(resumed) == GlobalBatchSampler(500, 4, 2, 1, seed=1, order="seeded").indices_at(9)


# ---------------------------------------------------------------- a stream's position


def test_a_stream_resumes_exactly_from_its_saved_position(tmp_path):
    folder = tmp_path / "stream"
    folder.mkdir()
    for name, lo in (("train-00000.jsonl", 0), ("train-00001.jsonl", 40), ("validation-00000.jsonl", 80)):
        (folder / name).write_text("".join(json.dumps({"text": f"doc {i}: " + "ab" * (i % 7)}) + "\n" for i in range(lo, lo + 40)))
    cfg = cfg_for(folder, block_size=16, streaming=True, tokenizer="byte")
    cfg.train.batch_size, cfg.eval.iters = 3, 2
    data = load_data(cfg)
    assert len(data.val_set) == 6 and data.train_set is None
    whole = data.train_stream(1, 0, None)
    expected = [next(whole) for _ in range(60)]  # more than two passes over the train files
    assert whole.epoch >= 2
    for stop in (1, 13, 27, 50):
        first = data.train_stream(1, 0, None)
        for _ in range(stop):
            next(first)
        position = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
        again = data.train_stream(1, 0, position)
        for k in range(stop, stop + 5):
            x, y = next(again)
            assert torch.equal(x, expected[k][0]) and torch.equal(y, expected[k][1]), (stop, k)
    rank0, rank1 = data.train_stream(2, 0, None), data.train_stream(2, 1, None)
    assert not torch.equal(next(rank0)[0], next(rank1)[0])  # split_dataset_by_node: one file each


def test_a_bad_input_found_late_leaves_the_prepared_folder_as_it_was(tmp_path, corpus):
    """--overwrite with inputs whose text column is missing: found while reading, before anything is replaced."""
    out = tmp_path / "out"
    prep(out, [corpus])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "rows.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match="--text_column: 'text' is not a column"):
        prep(out, [tmp_path / "rows.jsonl"], overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    lone = tmp_path / "tok"
    lone.mkdir()
    load_tokenizer("byte").save(lone)  # a folder holding only a tokenizer is not ours to clear
    with pytest.raises(UserError, match="is not empty and holds no prepared data"):
        prep(lone, [corpus])


def test_a_stream_without_the_text_column_says_so(tmp_path):
    folder = tmp_path / "stream"
    folder.mkdir()
    for name in ("train-00000.jsonl", "validation-00000.jsonl"):
        (folder / name).write_text('{"body": "some text"}\n' * 50)
    with pytest.raises(UserError, match="data.text_column: 'text' is not a column of .*; columns: body"):
        load_data(cfg_for(folder, streaming=True, tokenizer="byte"))


def test_a_malformed_json_row_is_named_by_its_line(tmp_path):
    """In memory, prepared and streamed: the file and the line of the first malformed row, in one line (pyarrow's own
    message counts rows within a block, and a stream raised it mid-run as a traceback)."""
    good = "".join(json.dumps({"text": f"row {i} has some text"}) + "\n" for i in range(40))
    folder = tmp_path / "stream"
    folder.mkdir()
    (folder / "train-00000.jsonl").write_text(good + '{"text": "no closing quote}\n' + good)
    (folder / "validation-00000.jsonl").write_text(good)
    where = f"{folder / 'train-00000.jsonl'}: the row on line 41 is not valid JSON"
    with pytest.raises(UserError, match=re.escape(f"data.path: {where}")):
        load_data(cfg_for(folder / "train-00000.jsonl"))
    with pytest.raises(UserError, match=re.escape(f"--input: {where}")):
        prep(tmp_path / "out", [folder / "train-00000.jsonl"])
    data = load_data(cfg_for(folder, block_size=16, streaming=True, tokenizer="byte"))
    with pytest.raises(UserError, match=re.escape(f"data.path: {where}")) as e:
        for _ in range(100):
            next(data.train_stream(1, 0, None))
    assert "\n" not in str(e.value)
    (folder / "rows.jsonl").write_text(good + "[1, 2]\n")
    with pytest.raises(UserError, match=re.escape("rows.jsonl: the row on line 41 is not a JSON object")):
        load_data(cfg_for(folder / "rows.jsonl"))


def test_a_stream_resumed_twice_inside_one_long_document_continues_exactly(tmp_path):
    """The position saved right after a resume, while the resumed document is still being read, must be the
    resumed one (a datasets stream reports its initial state until it is iterated)."""
    folder = tmp_path / "stream"
    folder.mkdir()
    for name in ("train-00000.jsonl", "validation-00000.jsonl"):
        (folder / name).write_text("".join(json.dumps({"text": " ".join(f"w{i}.{j}" for j in range(60))}) + "\n" for i in range(6)))
    cfg = cfg_for(folder, block_size=16, streaming=True, tokenizer="byte")
    cfg.train.batch_size, cfg.eval.iters = 1, 1
    data = load_data(cfg)
    whole = data.train_stream(1, 0, None)
    expected = [next(whole)[0] for _ in range(60)]
    first = data.train_stream(1, 0, None)
    for _ in range(25):  # inside the second document (about 21 windows each): windows differ between documents
        next(first)
    second = data.train_stream(1, 0, json.loads(json.dumps(first.state_dict())))
    next(second)  # still inside that document
    third = data.train_stream(1, 0, json.loads(json.dumps(second.state_dict())))
    assert all(torch.equal(next(third)[0], expected[k]) for k in range(26, 40))


def test_a_vocabulary_over_65536_ids_is_written_and_read_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.txt").write_text(" ".join(words[i * 997 % 70_000] for i in range(5000)) + "\n")
    meta = prep(tmp_path / "out", [tmp_path / "c.txt"], tokenizer=str(tmp_path / "tokenizer.json"))
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_001
    data = load_data(cfg_for(tmp_path / "out", block_size=8))
    x, _ = data.train_set.__getitems__([0])
    assert x[0, :3].tolist() == [0, 997, 1994] and data.vocab_size == 70_001
