"""A catalogue of bad inputs. Each: exit code 2, exactly one `error:` line naming the problem, no traceback,
and nothing in an existing run's output_dir created, changed or deleted.

Every case points output_dir at one finished run (unless output_dir itself is the bad input), so errors
raised after the run was found (resume=auto) are held to the same rule as config errors.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

import hf_tiny
from helpers import TINY, check, launch_env, run, snapshot, train_cmd, warm_cmd
from parallel_train.checkpoint import checkpointer
from parallel_train.data.prepare import Options, prepare
from parallel_train.data.tokenizers import CharVocab
from parallel_train.models.hf import HFConfig

pytestmark = pytest.mark.multiprocess

# The image cases run through train.py once model.name=hf is built for image classification (models/hf.py,
# HFConfig.tasks); until then tests/test_image_data.py holds each of their lines in process.
IMAGES_SERVED = "image-classification" in HFConfig.tasks
BASE = (*TINY, "train.max_steps=3", "train.lr_decay_steps=3", "eval.interval=3", "checkpoint.interval=3")


class Payload:
    """Unpickling this runs `touch MARKER`: if the marker appears, a checkpoint executed code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A finished run, and the bad files the cases point at."""
    tmp = tmp_path_factory.mktemp("bad")
    run_dir = tmp / "run"
    check(run(warm_cmd(1, *BASE, f"output_dir={run_dir}"), env=launch_env(tmp)))
    f = tmp / "files"
    f.mkdir()
    (f / "empty.txt").write_text("")
    (f / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (f / "short.txt").write_text("too short\n")
    (f / "rows.jsonl").write_text("".join('{"body": "some text here, long enough"}\n' for _ in range(50)))
    (f / "new_chars.txt").write_text("ZZZ 0123456789 \u00e9\u00e8 " * 200)
    (f / "bad.yaml").write_text("model: {n_layer: 2\n  broken: [\n")
    (f / "list.yaml").write_text("- model\n- train\n")
    (f / "a_file").write_text("not a folder\n")
    (f / "metric.py").write_text("def exact_match(logits, labels):\n    return None\n")
    (f / "twice.yaml").write_text("model:\n  n_layer: 2\ntrain:\n  batch_size: 4\nmodel:\n  n_head: 2\n")
    (f / "mixed").mkdir()
    (f / "mixed" / "play.txt").write_text("ZZZ 0123456789 \u00e9\u00e8 " * 200)
    (f / "mixed" / "shards.bin").write_bytes(bytes(range(256)))
    (f / "bad_row.jsonl").write_text('{"text": "a good row"}\n' * 20 + '{"text": "no closing quote}\n')
    no_unk = Tokenizer(models.WordLevel({"to": 0, "be": 1}, unk_token="[UNK]"))
    no_unk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    no_unk.save(str(f / "no_unk.json"))
    # 401 ids, more than the tiny Llama's 300 embedding rows.
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(400)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(f / "words401.json"))
    (f / "not_a_checkpoint").mkdir()
    # Prepared data (scripts/prepare_data.py's format): one with another tokenizer than the run's, one with a truncated shard.
    prepare(Options([str(f / "new_chars.txt")], f / "prepared_byte", "byte", num_proc=1), print_fn=lambda m: None)
    shutil.copytree(f / "prepared_byte", f / "prepared_truncated")
    (f / "prepared_truncated" / "train_000000.bin").write_bytes(b"\0" * 10)
    # Another tokenizer (10 characters) swapped in, prepared.json edited to match: the byte ids in the shards are beyond it.
    shutil.copytree(f / "prepared_byte", f / "prepared_ids_beyond")
    small = CharVocab(list("0123456789"))
    small.save(f / "prepared_ids_beyond")
    meta = json.loads((f / "prepared_ids_beyond" / "prepared.json").read_text())
    meta["tokenizer"].update(fingerprint=small.fingerprint, vocab_size=small.size)
    (f / "prepared_ids_beyond" / "prepared.json").write_text(json.dumps(meta))
    step = checkpointer.list_checkpoints(run_dir / "checkpoints")[-1]
    # A pickle in place of a rank's tensors, with the manifest rewritten to match (a careful attacker).
    replaced = f / "replaced" / step.name
    shutil.copytree(step, replaced)
    (replaced / "shards" / "rank00000-000.safetensors").write_bytes(pickle.dumps(Payload(tmp / "pwned_replaced")))
    checkpointer.write_manifest(replaced)
    # An extra pickle file next to the real ones.
    added = f / "added" / step.name
    shutil.copytree(step, added)
    (added / "extra_state.pkl").write_bytes(pickle.dumps(Payload(tmp / "pwned_added")))
    # Fine-tuning (issue 17): a tiny chat Llama, one without a chat template, and rows of conversations.
    hf_tiny.make_chat_model(f / "chat_llama")
    hf_tiny.save_model(hf_tiny.llama_config(), f / "plain_llama", hf_tiny.train_tokenizer())
    rows = hf_tiny.conversations(8, turns=1)
    (f / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (f / "no_messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [rows[0], {"messages": None}, *rows[1:]]))
    robot = {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "boop"}]}
    (f / "robot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [robot, *rows]))
    # Nothing to learn (issue 26): no assistant turn; empty answers under a template that marks the answer's text alone.
    (f / "no_answers.jsonl").write_text("".join(json.dumps({"messages": r["messages"][:2]}) + "\n" for r in rows))
    empty = [{"messages": [*r["messages"][:2], {"role": "assistant", "content": ""}]} for r in rows]
    (f / "empty_answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in empty))
    marked = "{% generation %}{{ m['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    assert marked in hf_tiny.CHAT_TEMPLATE_MARKED
    content_only = "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' + '\n' }}"
    (f / "content_only.jinja").write_text(hf_tiny.CHAT_TEMPLATE_MARKED.replace(marked, content_only))
    if IMAGES_SERVED:
        image_files(f)
    text_task_files(f)
    return {"tmp": tmp, "run": run_dir, "files": f}


def image_files(f: Path) -> None:
    """Image classification (issue 27): an imagefolder with one thing wrong each, a tiny ViT with and without its processor."""
    from transformers import ViTImageProcessor  # imported here: collecting this file stays cheap

    for name, folders in (("images_flat", ["."]), ("images_empty_class", ["cat", "dog", "fish"]), ("images_broken", ["cat", "dog"])):
        for folder in folders:
            (f / name / folder).mkdir(parents=True, exist_ok=True)
            if folder != "fish":
                Image.new("RGB", (8, 8)).save(f / name / folder / "0.png")
    (f / "images_broken" / "dog" / "1.png").write_bytes(b"not a png")
    for i in range(10):  # a good folder: 2 classes, 5 images each
        (f / "images_ok" / ["cat", "dog"][i % 2]).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i, 0, 0)).save(f / "images_ok" / ["cat", "dog"][i % 2] / f"{i}.png")
    for name, channels in (("vit", 3), ("vit_gray", 1)):  # tests/hf_tiny.py's ViT, one layer; and one of 1 channel
        hf_tiny.vit_config(num_hidden_layers=1, num_channels=channels).save_pretrained(f / name)
    shutil.copytree(f / "vit", f / "vit_bare")
    ViTImageProcessor(size=16).save_pretrained(f / "vit")
    ViTImageProcessor(size=16).save_pretrained(f / "vit_gray")


def text_task_files(f: Path) -> None:
    """The text tasks (issue 27): a masked-LM BERT with a WordPiece tokenizer, a seq2seq folder without
    decoder_start_token_id, a BPE without a mask token, and rows with one thing wrong each."""
    hf_tiny.save_task_model(hf_tiny.bert_config(), "AutoModelForMaskedLM", f / "bert")
    hf_tiny.bert_tokenizer(vocab_size=hf_tiny.VOCAB).save(str(f / "bert" / "tokenizer.json"))
    (f / "no_start").mkdir()
    shutil.copy(f / "bert" / "tokenizer.json", f / "no_start" / "tokenizer.json")
    (f / "no_start" / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True, "pad_token_id": 0}))
    hf_tiny.train_tokenizer().backend_tokenizer.save(str(f / "bpe.json"))
    rows = lambda path, rows: path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    rows(f / "scores.jsonl", [{"text": "hear me speak", "score": i % 2} for i in range(8)])
    (f / "glue").mkdir()
    rows(f / "glue" / "train.jsonl", [{"sentence": "hear me", "label": ["no", "yes"][i % 2]} for i in range(8)])
    rows(f / "glue" / "validation.jsonl", [{"sentence": "speak all", "label": "maybe"}])
    rows(f / "lines.jsonl", [{"text": "first citizen before we proceed"}] * 8)
    rows(f / "pairs.jsonl", [{"source": "hear me", "target": "speak all"}] * 8)


# model.name=hf on chat rows, in an output_dir of its own (the GPT run's tokenizer is not this model's)
CHAT = ["model.name=hf", "model.hf_path={files}/chat_llama", "model.block_size=128", "data.format=chat", "output_dir={files}/chat_out"]

# model.name=hf, random weights, a new output_dir
PLAIN_HF = ["model.name=hf", "model.hf_path={files}/plain_llama", "model.hf_pretrained=false", "resume=none", "output_dir={files}/new_out"]

# model.name=hf on an imagefolder, a new output_dir (model.task=image-classification, tasks/image_folder.py)
IMAGES = ["model.name=hf", "model.hf_path={files}/vit", "model.task=image-classification", "resume=none", "output_dir={files}/image_out"]

# model.name=hf on the text tasks' rows, a new output_dir (tasks/*.py: each task's reader)
TEXT = ["model.name=hf", "model.hf_path={files}/bert", "resume=none", "output_dir={files}/text_out"]

# (id, arguments; {run} {files} are filled in, what the error line must contain[, environment of the case])
CASES = [
    ("unknown_key", ["model.n_layers=2"], "unknown config key 'model.n_layers'"),
    (
        "mesh_bigger_than_world",
        ["parallel.tp=2"],
        "= 1 x 1 x 1 x 1 x 2 = 2 (parallel.* keys and the launch config), but 1 process was launched",
    ),
    ("section_as_value", ["model=3"], "config key 'model' is a section"),
    ("int_not_a_number", ["train.batch_size=abc"], "train.batch_size: expected an integer"),
    ("int_with_fraction", ["train.max_steps=2.5"], "train.max_steps: expected an integer"),
    ("bool_word", ["model.bias=maybe"], "model.bias: expected true or false"),
    ("closed_choice", ["train.optimizer=adamx"], "train.optimizer: must be one of"),
    ("dropout_range", ["model.dropout=1.5"], "model.dropout: must be in [0, 1)"),
    ("learning_rate_nan", ["train.learning_rate=nan"], "train.learning_rate: must be a finite number"),
    ("heads_do_not_divide", ["model.n_embd=31"], "model.n_embd (31) must be divisible by model.n_head"),
    ("min_lr_above_lr", ["train.min_lr=0.5"], "train.min_lr (0.5) must not exceed train.learning_rate"),
    ("keep_zero", ["checkpoint.keep=0"], "checkpoint.keep: must be >= 1"),
    ("timeout_zero", ["parallel.timeout_s=0"], "parallel.timeout_s: must be in [1, "),
    ("skipped_negative", ["train.max_skipped_steps=-1"], "train.max_skipped_steps: must be >= 0"),
    ("stray_argument", ["fast"], "unexpected argument 'fast'"),
    ("config_file_missing", ["--config", "{files}/nope.yaml"], "nope.yaml: no such file"),
    ("config_file_not_yaml", ["--config", "{files}/bad.yaml"], "bad.yaml: not valid YAML"),
    ("config_file_a_list", ["--config", "{files}/list.yaml"], "expected a mapping"),
    ("config_key_twice", ["--config", "{files}/twice.yaml"], "twice.yaml: key 'model' is written twice (lines 1 and 5)"),
    ("unknown_model", ["model.name=resnet"], "model.name: unknown model 'resnet'"),
    (
        "stage_devices_count",
        ["parallel.stage_devices=[cpu,cpu,cpu]", "parallel.pipeline_stages=2"],
        "parallel.stage_devices: 3 devices given for 2",
    ),
    ("data_missing", ["data.path={files}/missing.txt"], "data.path: no such file"),
    ("data_empty", ["data.path={files}/empty.txt"], "is empty"),
    ("data_binary", ["data.path={files}/binary.txt"], "is not UTF-8 text (a binary file?)"),
    ("data_too_short", ["data.path={files}/short.txt", "resume=none", "output_dir={files}/new_out"], "is too short"),
    (
        "data_column_missing",
        ["data.path={files}/rows.jsonl", "data.text_column=content", "resume=none", "output_dir={files}/new_out"],
        "data.text_column: 'content' is not a column",
    ),
    ("data_hub_offline", ["data.path=no-such-user/no-such-dataset"], "data.path: could not load"),
    ("data_outside_vocab", ["data.path={files}/new_chars.txt"], "vocab"),
    ("data_folder_other_kind", ["data.path={files}/mixed"], "mixed/shards.bin is not a .txt/.jsonl/.json/.csv/.parquet file"),
    ("data_json_row_malformed", ["data.path={files}/bad_row.jsonl"], "bad_row.jsonl: the row on line 21 is not valid JSON"),
    ("model_cannot_take_the_data", ["model.name=mlp"], "model.name=mlp takes feature vectors, but data.path="),
    (  # a new run: the resumed one may not change its tokenizer (run/resume_config.py)
        "tokenizer_unk_missing",
        ["data.tokenizer={files}/no_unk.json", "resume=none", "output_dir={files}/new_out"],
        "its unk token '[UNK]' is not in its vocabulary",
    ),
    (
        "prepared_ids_beyond_vocab",
        ["data.path={files}/prepared_ids_beyond"],
        "train_000000.bin holds token id 195, beyond the 10 ids of the tokenizer",
    ),
    ("prepared_other_tokenizer", ["data.path={files}/prepared_byte"], "the resumed run was trained with another tokenizer"),
    ("prepared_shard_truncated", ["data.path={files}/prepared_truncated"], "train_000000.bin is 10 bytes, prepared.json says"),
    ("resume_path_missing", ["resume={files}/no_such_checkpoint"], "resume: no such checkpoint"),
    ("resume_not_a_checkpoint", ["resume={files}/not_a_checkpoint"], "is not a valid checkpoint (no manifest.json"),
    ("resume_none_over_a_run", ["resume=none"], "already holds a run"),
    ("resume_other_model", ["model.n_embd=64"], "resume: model.n_embd (32 in the checkpoint, 64 now) cannot change"),
    ("resume_other_optimizer_setting", ["train.beta2=0.95"], "keys that may: train.max_steps, train.learning_rate"),
    # eval.metric may change on resume, so these reach the user's file (eval_metrics.user_metric; the rest in test_eval_metrics.py)
    ("eval_metric_no_file", ["eval.metric={files}/nope.py:exact_match"], "/nope.py: no such file (from "),
    ("eval_metric_no_function", ["eval.metric={files}/metric.py:exact"], "metric.py has no function exact (its functions: exact_match)"),
    # An environment left over from another launch, with no launcher (parallel/launch_env.py): the four cases of issue 21.
    ("leaked_rank", ["model.n_layers=2"], "the environment says RANK=1, but WORLD_SIZE is not above 1", {"RANK": "1"}),
    (
        "leaked_world_size",
        [],
        "WORLD_SIZE=2 (a process of a distributed launch), but RANK, MASTER_ADDR, MASTER_PORT are not set",
        {"WORLD_SIZE": "2"},
    ),
    ("leaked_world_size_and_master", [], "but RANK, MASTER_PORT are not set", {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}),
    ("leaked_local_rank", [], "LOCAL_RANK=0 (a process of a distributed launch), but WORLD_SIZE, RANK", {"LOCAL_RANK": "0"}),
    ("output_dir_is_a_file", ["output_dir={files}/a_file"], "is a file"),
    ("output_dir_not_writable", ["output_dir={files}/a_file/sub"], "is not writable"),
    ("checkpoint_pickle_replaced", ["resume={files}/replaced/step_0000003"], "rank00000-000.safetensors is a pickle; refusing"),
    ("checkpoint_pickle_added", ["resume={files}/added/step_0000003"], "extra_state.pkl is a pickle-type file; refusing"),
    # Fine-tuning (issue 17): chat data, LoRA, packing. A new output_dir: these fail before anything is written there.
    (
        "chat_rows_without_messages",
        [*CHAT, "data.path={files}/no_messages.jsonl"],
        "no_messages.jsonl: row 2 has no messages in 'messages'",
    ),
    (
        "chat_role_unknown",
        [*CHAT, "data.path={files}/robot.jsonl"],
        "robot.jsonl: row 1: the chat template refused it (Unknown role: robot)",
    ),
    (
        "chat_sample_longer_than_block",
        [*CHAT, "data.path={files}/chats.jsonl", "model.block_size=16"],
        "longer than model.block_size + 1 = 17; raise model.block_size, or cut such samples with data.truncate=true",
    ),
    (
        "chat_without_template",
        [*CHAT, "data.path={files}/chats.jsonl", "model.hf_path={files}/plain_llama"],
        "plain_llama' has no chat template; give one with data.chat_template=FILE",
    ),
    (
        "lora_targets_match_nothing",
        [*CHAT, "data.path={files}/chats.jsonl", "data.truncate=true", "model.lora_rank=8", "model.lora_targets=[nothing]"],
        "model.lora_targets: Target modules {'nothing'} not found in the base model",
    ),
    # A tokenizer or vocabulary larger than the model's embedding: one line at the start, not an index error mid-run.
    (
        "tokenizer_beyond_the_embedding",
        [*PLAIN_HF, "data.tokenizer={files}/words401.json"],
        "the tokenizer has 401 ids but model.hf_path",
    ),
    (
        "hf_vocab_size_beyond_the_embedding",
        [*PLAIN_HF, "model.vocab_size=400"],
        "model.vocab_size=400 exceeds the 300 embedding rows of model.hf_path",
    ),
    (
        "gpt_vocab_size_below_the_tokenizer",
        ["model.vocab_size=10", "resume=none", "output_dir={files}/new_out"],
        "model.vocab_size=10 is smaller than the tokenizer's 65 ids; set model.vocab_size=0",
    ),
    (
        "chat_without_an_assistant_turn",
        [*CHAT, "data.path={files}/no_answers.jsonl"],
        "no_answers.jsonl' has nothing to learn in its train split (7 samples): no row has an assistant turn",
    ),
    (
        "chat_every_answer_empty",
        [*CHAT, "data.path={files}/empty_answers.jsonl", "data.chat_template={files}/content_only.jinja"],
        "empty_answers.jsonl' has nothing to learn in its train split (7 samples): every answer is empty",
    ),
    (
        "chat_answers_truncated_away",
        [*CHAT, "data.path={files}/chats.jsonl", "data.truncate=true", "model.block_size=8"],
        "chats.jsonl' has nothing to learn in its train split (7 samples): data.truncate=true cut every answer away",
    ),
    (
        "lora_targets_only_embeddings",
        [*CHAT, "data.path={files}/chats.jsonl", "data.truncate=true", "model.lora_rank=8", "model.lora_targets=[embed_tokens]"],
        "model.lora_targets=['embed_tokens'] matched model.embed_tokens (Embedding); LoRA here adapts Linear layers",
    ),
    (
        "lora_alpha_without_rank",
        [*CHAT, "data.path={files}/chats.jsonl", "model.lora_alpha=32"],
        "model.lora_alpha: set, but model.lora_rank=0, so no adapters are made and every weight would train",
    ),
    ("lora_with_gpt", ["model.lora_rank=8"], "model.lora_rank: a key of model.name=hf only (LoRA adapts a pretrained Hugging Face model)"),
    ("packing_text_windows", ["data.packing=true"], "data.packing: applies to samples (data.format=chat or instruction)"),
    (
        "packing_model_without_positions",
        ["model.name=mlp", "data.format=instruction", "data.packing=true"],
        "data.packing: model.name=mlp does not take a packed batch's positions",
    ),
]

# The text tasks through train.py (tests/test_task_data.py holds every one of their lines in process).
CASES += [
    (
        "text_task_columns_missing",
        [*TEXT, "model.task=sequence-classification", "data.path={files}/scores.jsonl"],
        "scores.jsonl has the columns text, score, none of model.task=sequence-classification's layouts",
    ),
    (
        "text_task_label_only_in_validation",
        [*TEXT, "model.task=sequence-classification", "data.path={files}/glue"],
        "has the label 'maybe', which no train row has (train labels: no, yes)",
    ),
    (
        "masked_lm_tokenizer_without_mask",
        [*TEXT, "model.task=masked-lm", "data.path={files}/lines.jsonl", "data.tokenizer={files}/bpe.json"],
        "has no mask token",
    ),
    (
        "seq2seq_without_decoder_start",
        [*TEXT, "model.task=seq2seq", "model.hf_path={files}/no_start", "data.path={files}/pairs.jsonl"],
        "config.json has no decoder_start_token_id",
    ),
    (  # issue 34: it asked for a decoder_start_token_id, and failed another way once given one
        "seq2seq_on_an_encoder",
        [*TEXT, "model.task=seq2seq", "data.path={files}/pairs.jsonl"],
        "is a bert, not an encoder-decoder",
    ),
]

IMAGE_CASES = [
    ("image_not_in_a_class_folder", [*IMAGES, "data.path={files}/images_flat"], "images_flat/0.png is not in a class folder"),
    ("image_class_folder_empty", [*IMAGES, "data.path={files}/images_empty_class"], "images_empty_class/fish holds no image"),
    ("image_unreadable", [*IMAGES, "data.path={files}/images_broken"], "images_broken/dog/1.png is not an image Pillow can read"),
    (  # checked before step 1 on the model as it starts (data/batch_check.py); a ValueError inside step 1 before
        "image_model_of_one_channel",
        [*IMAGES, "data.path={files}/images_ok", "model.hf_path={files}/vit_gray", "model.hf_pretrained=false"],
        "the batch's 'pixel_values' have 3 channels (3x16x16), but model.hf_path",
    ),
    (
        "image_processor_missing",
        [*IMAGES, "data.path={files}/images_broken", "model.hf_path={files}/vit_bare"],
        "vit_bare' has no preprocessor_config.json (the image processor",
    ),
]
if IMAGES_SERVED:
    CASES += IMAGE_CASES


def fill(args: list[str], env) -> list[str]:
    args = [a.format(run=env["run"], files=env["files"]) for a in args]
    if not any(a.startswith("output_dir=") for a in args):
        args.append(f"output_dir={env['run']}")
    return [*BASE, *args]


@pytest.fixture(scope="module")
def results(env):
    """Every case: train.py's own entry point in a process forked from the warm launcher (tests/warm_launcher.py), with
    its own exit code and output; one at a time, as most cases share the watched run's output_dir, which one run at a
    time may hold (run/output_dir.py). The watched run is hashed after each case."""
    before, outcome = snapshot(env["run"]), {}
    for case_id, args, _, *extra in CASES:
        r = run(warm_cmd(1, *fill(args, env)), env=launch_env(env["tmp"], **(extra[0] if extra else {})), timeout=120)
        outcome[case_id] = {"returncode": r.returncode, "output": r.output, "snapshot": snapshot(env["run"])}
    return before, outcome


def assert_one_line_error(returncode: int, output: str, expected: str) -> None:
    assert returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], output[-3000:]


@pytest.mark.parametrize("case_id, expected", [pytest.param(i, e, id=i) for i, _, e, *_ in CASES])
def test_bad_input(env, results, case_id, expected):
    before, outcome = results
    assert_one_line_error(outcome[case_id]["returncode"], outcome[case_id]["output"], expected)
    assert outcome[case_id]["snapshot"] == before
    assert not list(env["tmp"].glob("pwned_*")), "a checkpoint executed code"


def test_chat_errors_leave_no_file_in_their_output_dir(env, results):
    """The chat cases' own output_dir: every one stopped before the run wrote a file there (data and model are read
    before config.yaml, metrics.jsonl or a checkpoint; the lock is removed on the way out)."""
    assert not [p for p in (env["files"] / "chat_out").rglob("*") if p.is_file()]


def test_a_launch_of_train_py_says_the_same(env):
    """The forked cases run train.py's own entry point; one real launch shows the launch path ends the same way."""
    before = snapshot(env["run"])
    result = run(train_cmd(*fill(["checkpoint.keep=0"], env)), env=launch_env(env["tmp"]), timeout=180)
    assert_one_line_error(result.returncode, result.output, "checkpoint.keep: must be >= 1")
    assert snapshot(env["run"]) == before
