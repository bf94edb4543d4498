"""Image classification data (model.task=image-classification, tasks/image_folder.py): an imagefolder of tiny PNGs
through a tiny ViT image processor. Batches, class ids and names, both layouts, the same pixels on every topology
and after a resume, the classes kept across a resume, and every bad folder as one line. The cv_example recipe as
written on a tiny ResNet (its family) through the real Trainer, and a ResNet's keys it cannot take as one line each."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

import hf_tiny
from helpers import REPO, WarmCmd, launch_env, run, snapshot, train_losses
from parallel_train.config.load import load_config
from parallel_train.data.text import train_loader, val_loader
from parallel_train.errors import UserError
from parallel_train.models.hf import HFConfig, HFModel
from parallel_train.run.resume_config import check_same_files
from parallel_train.tasks.label_names import LABELS_FILE as FILE
from parallel_train.tasks.registry import TASKS

COLOURS = {"cat": (255, 0, 0), "dog": (0, 255, 0), "bird": (0, 0, 255)}


def make_images(folder, classes=tuple(COLOURS), per_class=4) -> None:
    """per_class PNGs per class, of uneven sizes (8x8 to 11x8) and shades, so every image is a different one."""
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            colour = tuple(max(0, c - 40 * i) for c in COLOURS.get(name, (9, 9, 9)))
            Image.new("RGB", (8 + i, 8), colour).save(folder / name / f"{i}.png")


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """A tiny ViT classifier's model folder (tests/hf_tiny.py) with its image processor (16 x 16)."""
    return hf_tiny.save_task_model(hf_tiny.vit_config(), "AutoModelForImageClassification", tmp_path_factory.mktemp("vit"))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """cv_example's family, tiny: a ResNet classifier (tests/hf_tiny.py) whose head names two ImageNet classes, as
    microsoft/resnet-50's names its 1,000, with its image processor (a centre crop of 16 x 16)."""
    names = ["tench", "goldfish"]
    head = dict(num_labels=2, id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    return hf_tiny.save_task_model(hf_tiny.resnet_config(**head), "AutoModelForImageClassification", tmp_path_factory.mktemp("resnet"))


def config(folder, processor, *more: str):
    cfg, _ = load_config(
        [
            "model.name=hf",
            "model.task=image-classification",
            f"model.hf_path={processor}",
            f"data.path={folder}",
            "train.batch_size=2",
            *more,
        ]
    )
    return cfg


def load(folder, processor, *more: str):
    return TASKS["image-classification"].load(config(folder, processor, *more), None)


def test_batches_are_pixel_values_and_class_ids_named_by_sorted_folders(tmp_path, processor):
    make_images(tmp_path / "pets")
    data = load(tmp_path / "pets", processor, "data.val_fraction=0.25")
    assert data.label_names == ["bird", "cat", "dog"]  # datasets' ClassLabel: the folder names sorted
    assert json.loads(data.files[FILE]) == data.label_names and data.vocab is None and data.vocab_size == 3
    assert (len(data.train_set), len(data.val_set)) == (9, 3)
    batch = data.train_set.__getitems__(list(range(len(data.train_set))))
    assert set(batch) == {"pixel_values", "labels"}
    assert batch["pixel_values"].shape == (9, 3, 16, 16) and batch["pixel_values"].dtype == torch.float32  # one size for 8..11 px
    assert batch["labels"].dtype == torch.int64
    for i, file in enumerate(data.train_set.files):
        assert data.label_names[batch["labels"][i]] == file.parent.name
        # A red cat (255, 0, 0) is (1, -1, -1) after the processor's rescale and normalisation; each image alone as in a batch.
        colour = torch.tensor(Image.open(file).getpixel((0, 0)), dtype=torch.float32) / 127.5 - 1
        assert torch.allclose(batch["pixel_values"][i, :, 0, 0], colour, atol=1e-5)
        assert torch.equal(data.train_set[i]["pixel_values"], batch["pixel_values"][i])


def test_validation_folder_and_a_fixed_validation_share(tmp_path, processor):
    make_images(tmp_path / "split" / "train")
    make_images(tmp_path / "split" / "validation", classes=("cat", "dog"), per_class=2)
    make_images(tmp_path / "split" / "test", classes=("fish",), per_class=1)  # not read: test/ is left out
    (tmp_path / "split" / "README.md").write_text("a dataset card\n")
    data = load(tmp_path / "split", processor)
    assert data.label_names == ["bird", "cat", "dog"] and (len(data.train_set), len(data.val_set)) == (12, 4)
    assert "from validation/" in data.description
    # Without validation/: data.val_fraction of the images, the same draw on every load and whatever train.seed.
    make_images(tmp_path / "flat")
    draws = [load(tmp_path / "flat", processor, f"train.seed={seed}").val_set.files for seed in (1, 1, 2)]
    assert draws[0] == draws[1] == draws[2] and len(draws[0]) == 1  # 10% of 12


def test_every_topology_and_a_resume_see_the_same_pixels(tmp_path, processor):
    """Rank 0 and rank 1 of two processes read what one process reads, and a loader resumed at step 1 reads what the
    uninterrupted one read second: the images are read and processed per sample, with no random augmentation."""
    make_images(tmp_path / "pets")
    cfg = config(tmp_path / "pets", processor)
    data = TASKS["image-classification"].load(cfg, None)
    one = iter(train_loader(data, cfg, 1, 0, 0, False))
    first, second = next(one), next(one)
    halves = [next(iter(train_loader(data, cfg, 2, rank, 0, False))) for rank in (0, 1)]
    for key in first:
        assert torch.equal(torch.cat([h[key] for h in halves]), torch.cat([first[key], second[key]]))
    resumed = next(iter(train_loader(data, cfg, 1, 0, 1, False)))
    assert all(torch.equal(resumed[k], second[k]) for k in second)
    assert torch.equal(next(iter(val_loader(data, cfg, 1)))["pixel_values"], next(iter(val_loader(data, cfg, 1)))["pixel_values"])


def test_a_resume_on_other_classes_is_refused(tmp_path, processor):
    make_images(tmp_path / "pets")
    data = load(tmp_path / "pets", processor)
    checkpoint = tmp_path / "step_0000002"
    checkpoint.mkdir()
    (checkpoint / FILE).write_text(data.files[FILE])
    check_same_files(checkpoint, data.files)  # the same classes: nothing to say
    make_images(tmp_path / "pets", classes=("fish",))
    with pytest.raises(
        UserError, match=r"learned other classes \(3 classes before, 4 now; label id 3 was none, is 'fish'.*resume with the data"
    ):
        check_same_files(checkpoint, load(tmp_path / "pets", processor).files)


def test_a_resnet_names_the_attention_and_checkpointing_keys_it_cannot_take_in_one_line(resnet):
    """transformers has no sdpa attention (the default) and no activation checkpointing for a ResNet: each is one line
    naming the key and the value it takes (cv_example sets model.attn_implementation=eager)."""
    keys = dict(name="hf", hf_path=str(resnet), task="image-classification")
    with pytest.raises(UserError, match=r"^model.attn_implementation=sdpa: .*ResNet.*; set model.attn_implementation=eager$") as e:
        HFModel(HFConfig(**keys), 0)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"^model.activation_checkpointing=full: .*ResNet.*model.activation_checkpointing=none") as e:
        HFModel(HFConfig(**keys, attn_implementation="eager", activation_checkpointing="full"), 0)
    assert "\n" not in str(e.value)
    assert HFModel(HFConfig(**keys, attn_implementation="eager"), 0).hf.config.model_type == "resnet"


@pytest.mark.multiprocess
def test_the_cv_example_recipe_trains_alike_on_one_and_two_processes_and_keeps_its_classes(tmp_path, resnet):
    """configs/cv_example.yaml as written, tiny (a tiny ResNet, its family: model.name=hf, a new head for the pets as
    the recipe's on ImageNet's classes) through the real Trainer: one process == two (DDP), no tokenizer to save, the
    class names saved with the run and every checkpoint; a resume on other classes is one line and leaves the run as
    it was."""
    make_images(tmp_path / "pets")
    args = ["--config", "configs/cv_example.yaml", f"model.hf_path={resnet}", f"data.path={tmp_path / 'pets'}"]
    args += ["data.num_workers=0", "train.max_steps=2", "train.warmup_steps=1", "train.lr_decay_steps=2", "train.log_interval=1"]
    args += ["eval.interval=2", "eval.iters=1", "eval.batch_size=4", "checkpoint.interval=2", "tracker=none"]
    env, one, two = launch_env(tmp_path), tmp_path / "one", tmp_path / "two"
    # Micro-batches of 2 on both: a ResNet's batch norm normalises each micro-batch by its own statistics, so one
    # process accumulating two of 2 is what two processes of 2 are (one of 4 is not); DDP shares no statistics.
    runs = [(1, one, "train.batch_size=2 train.gradient_accumulation_steps=2"), (2, two, "train.batch_size=2")]
    for nproc, out, batch in runs:
        result = run(WarmCmd(nproc, "train.py", (*args, *batch.split(), f"output_dir={out}")), env=env, timeout=120)
        assert result.returncode == 0, result.output[-3000:]
    assert list(train_losses(one)) == [1, 2]
    assert train_losses(one) == pytest.approx(train_losses(two), abs=1e-5)
    assert json.loads((one / FILE).read_text()) == ["bird", "cat", "dog"]
    exported = json.loads((one / "hf" / "config.json").read_text())  # a new head of the pets' classes (model.new_head)
    assert exported["architectures"] == ["ResNetForImageClassification"] and exported["id2label"] == {"0": "bird", "1": "cat", "2": "dog"}
    assert (one / "checkpoints" / "step_0000002" / FILE).is_file() and not (one / "vocab.json").exists()
    shutil.copytree(tmp_path / "pets", tmp_path / "more")
    make_images(tmp_path / "more", classes=("fish",))
    before = snapshot(one)
    more = (*args, "train.batch_size=4", f"output_dir={one}", f"data.path={tmp_path / 'more'}", "train.max_steps=3")
    refused = run(WarmCmd(1, "train.py", more), env=env, timeout=120)
    errors = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1 and "is 'fish'" in errors[0], refused.output[-3000:]
    assert "Traceback" not in refused.output and snapshot(one) == before


def test_an_image_that_fails_to_decode_in_a_loader_worker_is_one_line(tmp_path, processor):
    """A truncated PNG passes the start's header check and fails when its batch is drawn, in a DataLoader worker
    (data.num_workers=1): torch raises it again in the training process, and the error is still one line."""
    make_images(tmp_path / "pets")
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "big.png")
    big = (tmp_path / "big.png").read_bytes()
    (tmp_path / "pets" / "cat" / "0.png").write_bytes(big[: len(big) // 2])
    cfg = config(tmp_path / "pets", processor, "data.num_workers=1")
    data = TASKS["image-classification"].load(cfg, None)
    batches = iter(train_loader(data, cfg, 1, 0, 0, False))
    with pytest.raises(UserError) as e:
        for _ in range(len(data.train_set)):  # every sample at least once
            next(batches)
    broken = tmp_path / "pets" / "cat" / "0.png"
    assert str(e.value) == f"data.path: {broken} is not an image Pillow can read (image file is truncated); remove or replace it"


@pytest.mark.skipif(
    "image-classification" not in HFConfig.tasks, reason="model.name=hf is built for causal LMs only until it serves images"
)
def test_the_cv_example_config_loads_as_written(processor):
    """configs/cv_example.yaml with model.name=hf (docs/guide.md 5a), the model folder made here."""
    cfg, _ = load_config(["--config", str(REPO / "configs" / "cv_example.yaml"), f"model.hf_path={processor}"])
    assert (cfg.model.name, cfg.model.task, cfg.data.val_fraction, cfg.train.batch_size) == ("hf", "image-classification", 0.2, 64)


def folder_with(tmp_path, what: str):
    """A folder with one thing wrong (the ids of BAD_FOLDERS)."""
    root = tmp_path / what
    if what == "no_class_folders":
        root.mkdir()
        Image.new("RGB", (8, 8)).save(root / "a.png")
    elif what == "one_class":
        make_images(root, classes=("cat",))
    elif what == "empty_class":
        make_images(root)
        (root / "fish").mkdir()
    elif what == "not_an_image":
        make_images(root)
        (root / "cat" / "notes.txt").write_text("cats are nice\n")
    elif what == "broken_png":
        make_images(root)
        (root / "dog" / "9.png").write_bytes(b"not a png at all")
    elif what == "validation_class_not_trained":
        make_images(root / "train")
        make_images(root / "validation", classes=("fish",), per_class=1)
    elif what == "no_train_folder":
        make_images(root / "validation")
    elif what == "empty":
        root.mkdir()
    elif what == "a_file":
        root.write_text("not a folder\n")
    return root


BAD_FOLDERS = [
    ("no_class_folders", "no_class_folders/a.png is not in a class folder; an imagefolder holds CLASS/IMAGE files"),
    ("one_class", "has one class folder (cat); a classifier needs two or more"),
    ("empty_class", "the class folder {root}/fish holds no image; add images to it or remove it"),
    ("not_an_image", "not_an_image/cat/notes.txt is not an image (.png, .jpg, .jpeg, .webp, .bmp, ...); move it out"),
    ("broken_png", "broken_png/dog/9.png is not an image Pillow can read (not a format it knows); remove or replace it"),
    ("validation_class_not_trained", "the class 'fish' has validation images but no train/fish/ folder"),
    ("no_train_folder", "has validation folders but no train/"),
    ("empty", "holds no files; an imagefolder holds"),
    ("a_file", "is not a folder; model.task=image-classification reads an imagefolder"),
]


@pytest.mark.parametrize("what, expected", BAD_FOLDERS, ids=[b[0] for b in BAD_FOLDERS])
def test_a_bad_folder_is_one_line(tmp_path, processor, what, expected):
    root = folder_with(tmp_path, what)
    with pytest.raises(UserError) as e:
        load(root, processor)
    assert expected.format(root=root) in str(e.value) and "\n" not in str(e.value), e.value


def test_a_model_folder_without_an_image_processor_is_one_line(tmp_path, processor):
    make_images(tmp_path / "pets")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(processor / "config.json", bare)
    with pytest.raises(UserError, match=r"has no preprocessor_config.json \(the image processor that makes the model's pixel_values\)"):
        load(tmp_path / "pets", bare)
    with pytest.raises(UserError, match=r"data.val_fraction=0.05 of 12 images leaves 0 for validation"):
        load(tmp_path / "pets", processor, "data.val_fraction=0.05")


# ---------------------------------------------------------------- what the model takes, checked at start (issue 34, kind 9)


def model_folder(tmp_path, name: str, size: int = 16, **config) -> str:
    """A tiny ViT classifier's folder whose image processor makes `size` x `size` pixels."""
    from transformers import ViTImageProcessor

    folder = hf_tiny.save_task_model(hf_tiny.vit_config(**config), "AutoModelForImageClassification", tmp_path / name)
    ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(folder)
    return folder


def start_check(folder, model_folder) -> None:
    """The Trainer's check of the first batches (data/batch_check.py), on the model as it starts (on the meta device)."""
    from parallel_train.data.batch_check import check_first_batches
    from parallel_train.models import MODELS
    from parallel_train.parallel.model_init import start_model

    cfg = config(folder, model_folder, "model.new_head=true")  # the tiny models' heads are unnamed: start them anew
    data = TASKS["image-classification"].load(cfg, None)
    model = start_model(MODELS["hf"], cfg.model, data.vocab_size, 0, data.label_names)[0]
    check_first_batches(model, data, cfg, TASKS["image-classification"], next(iter(val_loader(data, cfg, 1))))


@pytest.mark.parametrize(
    "name, settings, says",
    [
        (
            "gray",
            {"num_channels": 1},
            "the batch's 'pixel_values' have 3 channels (3x16x16), but model.hf_path '{model}' takes 1 (num_channels in its "
            "config.json); give a model of 3 channels, or an image processor that makes 1",
        ),
        (
            "small",
            {"size": 32},
            "model.hf_path '{model}' cannot take the batch's 'pixel_values' of 3x32x32 (Input image size (32*32) doesn't match "
            "model (16*16).); give its image processor (preprocessor_config.json) the size the model was made for",
        ),
    ],
)
def test_pixels_the_model_cannot_take_are_one_line_at_start(tmp_path, processor, name, settings, says):
    """A 1-channel model on RGB images, a processor of another size than the model's: a ValueError inside step 1 before."""
    make_images(tmp_path / "pets")
    model = model_folder(tmp_path, name, **settings)
    start_check(tmp_path / "pets", processor)  # the model its processor was made for starts
    with pytest.raises(UserError) as e:
        start_check(tmp_path / "pets", model)
    assert str(e.value) == "model.task=image-classification's data: " + says.format(model=model)


@pytest.mark.parametrize("limit, kind", [(30, "error"), (50, "warning")])
def test_a_decompression_bomb_is_one_line_naming_the_file(tmp_path, processor, monkeypatch, limit, kind):
    """Pillow refuses an image of more than twice Image.MAX_IMAGE_PIXELS (DecompressionBombError) and warns above it
    (DecompressionBombWarning): both are one line naming the file (before: a traceback, or a warning and a huge
    image read at every batch). Here the limit is lowered under the 8 x 8 test images."""
    from PIL import Image as PILImage

    make_images(tmp_path / "pets")
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(UserError) as e:
        load(tmp_path / "pets", processor)
    bird = tmp_path / "pets" / "bird" / "0.png"
    assert str(e.value).startswith(f"data.path: {bird} is more pixels than Pillow opens (Image size (64 pixels) exceeds limit of "), kind
    assert str(e.value).endswith("could be decompression bomb DOS attack.); shrink it, or remove it")


def test_a_class_folder_that_is_a_symbolic_link_is_followed(tmp_path, processor):
    """User case 11: a class folder linked from elsewhere 'held no image' (datasets' listing does not enter links)."""
    make_images(tmp_path / "elsewhere", classes=("dog",))
    make_images(tmp_path / "pets", classes=("bird", "cat"))
    (tmp_path / "pets" / "dog").symlink_to(tmp_path / "elsewhere" / "dog")
    data = load(tmp_path / "pets", processor, "data.val_fraction=0.25")
    assert data.label_names == ["bird", "cat", "dog"] and len(data.train_set) + len(data.val_set) == 12
    make_images(tmp_path / "split" / "train", classes=("bird", "cat"))
    make_images(tmp_path / "split" / "validation", classes=("bird",), per_class=2)
    (tmp_path / "split" / "train" / "dog").symlink_to(tmp_path / "elsewhere" / "dog")
    (tmp_path / "split" / "validation" / "dog").symlink_to(tmp_path / "elsewhere" / "dog")
    data = load(tmp_path / "split", processor)
    assert data.label_names == ["bird", "cat", "dog"] and (len(data.train_set), len(data.val_set)) == (12, 6)
    only_links = tmp_path / "linked"
    only_links.mkdir()
    for name in ("cat", "dog"):
        (only_links / name).symlink_to(tmp_path / "pets" / name)
    assert load(only_links, processor, "data.val_fraction=0.25").label_names == ["cat", "dog"]
