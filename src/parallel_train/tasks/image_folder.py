"""Image classification data: an imagefolder (one folder of images per class, as `datasets`' "imagefolder" builder
reads it), each image turned into the model's `pixel_values` by the image processor of model.hf_path.

    data.path/cat/1.png, data.path/dog/2.png, ...                   validation: data.val_fraction of the images
    data.path/train/cat/1.png, data.path/validation/cat/9.png, ...  validation: the validation/ folder

Which files belong to which split is `datasets`' own rule (data_files.get_data_patterns: train/, validation/ or
val/ or dev/, test/ left out), and so are the image extensions and the class ids: the class folder names sorted,
as its ClassLabel numbers them. Every image is checked before training (a file that is not an image, a class
folder without one: one line each), and read again at every batch: nothing is held in memory but the paths.

Pixels are the same on every topology and across a resume: no random augmentation, the processor's PIL backend
whether torchvision is installed or not, and a fixed draw for the validation share (the same whatever train.seed).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from parallel_train.config.sections import Config
from parallel_train.data.text import Data
from parallel_train.errors import UserError
from parallel_train.tasks.label_names import head_names, names_file, with_head

LAYOUT = "CLASS/IMAGE files, or train/CLASS/IMAGE and validation/CLASS/IMAGE"
PROCESSOR_FILE = "preprocessor_config.json"
SPLIT_SEED = 0  # the validation share is one fixed draw: runs of any train.seed are judged on the same images
INSTALL = "pip install -r requirements-hf.txt"


def load_images(cfg: Config, saved: Any = None) -> Data:
    """The image-classification data of data.path (`saved`, a resumed run's tokenizer, is always None: images have
    none; the classes are checked against the checkpoint's label_names.json by the trainer)."""
    root = Path(cfg.data.path).expanduser()
    if not root.is_dir():
        raise UserError(f"data.path: {cfg.data.path!r} is not a folder; model.task=image-classification reads an imagefolder ({LAYOUT})")
    processor = image_processor(cfg.model)  # first: a missing one is one line before any image is read
    splits = split_images(root)
    names = with_head(class_names(root, splits), head_names(cfg))  # a pretrained head's names first, in its rows' order
    if "validation" in splits:
        train, val, how = splits["train"], splits["validation"], "from validation/"
    else:
        train, val = fraction_split(splits["train"], cfg.data.val_fraction)
        how = f"data.val_fraction={cfg.data.val_fraction} of {len(splits['train'])}"
    ids = {name: i for i, name in enumerate(names)}
    train_set, val_set = (ImageSamples(files, [ids[f.parent.name] for f in files], processor) for files in (train, val))
    shape = tuple(train_set.__getitems__([0])["pixel_values"].shape[1:])
    train_set.shape = val_set.shape = shape  # every batch the same size: pipelines and torch.compile need fixed shapes
    description = (
        f"imagefolder {cfg.data.path}: {len(train)} train and {len(val)} validation images ({how}), {len(names)} classes "
        f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}), pixel_values {'x'.join(map(str, shape))} "
        f"by {type(processor).__name__} ({getattr(cfg.model, 'hf_path', '')})"
    )
    return Data(
        train_set,
        val_set,
        None,  # no tokenizer: nothing to save but the class names
        len(names),
        all_targets_count=True,  # one class id per image, never IGNORE_INDEX
        inputs="images",
        files=names_file(names),
        label_names=names,
        description=description,
    )


# ---------------------------------------------------------------- the folder


def split_images(root: Path) -> dict[str, list[Path]]:
    """{"train": images, ["validation": images]}, each image in a class folder, every file of a class folder an
    image, every class folder holding one; test/ and files outside class folders (a README) are left out."""
    import datasets  # lazy: about 1.7 s, and only image data needs this module
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    datasets.disable_progress_bars()
    try:
        patterns = {str(split): p for split, p in get_data_patterns(str(root)).items()}  # datasets' NamedSplit keys as plain names
        files = {str(split): f for split, f in DataFilesDict.from_patterns(patterns, base_path=str(root)).items()}
    except EmptyDatasetError:  # no file but through links, maybe
        patterns, files = {"train": ["**"]}, {}
    depth = 2 if patterns == {"train": ["**"]} else 3  # no split folders: CLASS/IMAGE; else SPLIT/CLASS/IMAGE
    for split, linked in linked_files(root, depth).items():
        files[split] = [*files.get(split, []), *linked]
    if not files:
        raise UserError(f"data.path: {str(root)!r} holds no files; an imagefolder holds {LAYOUT}")
    if "train" not in files:
        raise UserError(f"data.path: {str(root)!r} has {', '.join(files)} folders but no train/; an imagefolder holds {LAYOUT}")
    extensions = set(ImageFolder.EXTENSIONS)
    splits = {split: class_images(root, files[split], depth, extensions) for split in ("train", "validation") if split in files}
    for images in splits.values():
        check_class_folders(root, images)
    for image in (i for images in splits.values() for i in images):
        check_readable(image)
    return splits


def linked_files(root: Path, depth: int) -> dict[str, list[str]]:
    """{split: the files of its class folders that are symbolic links to folders}, which datasets' listing does not
    enter; each file by its path through the link, so that its class is the link's name."""
    from datasets.data_files import SPLIT_KEYWORDS

    splits = {word: str(split) for split, words in SPLIT_KEYWORDS.items() for word in words}
    found: dict[str, list[str]] = {}
    for link in sorted(root.glob("*" if depth == 2 else "*/*")):
        split = "train" if depth == 2 else splits.get(link.parent.name.lower())
        if link.is_symlink() and link.is_dir() and split in ("train", "validation"):
            found.setdefault(split, []).extend(str(f) for f in sorted(link.iterdir()) if f.is_file() and not f.name.startswith("."))
    return found


def class_images(root: Path, files: list[str], depth: int, extensions: set[str]) -> list[Path]:
    """The images among `files`, each `depth` parts below root (in a class folder); a file of another kind in a
    class folder, or an image elsewhere, is one line."""
    images = []
    for file in map(Path, sorted(files)):
        rel, is_image = file.relative_to(root), file.suffix.lower() in extensions
        if len(rel.parts) == depth and is_image:
            images.append(file)
        elif len(rel.parts) == depth:
            raise UserError(f"data.path: {file} is not an image (.png, .jpg, .jpeg, .webp, .bmp, ...); move it out of the class folder")
        elif is_image:
            raise UserError(f"data.path: {file} is not in a class folder; an imagefolder holds {LAYOUT}")
    if not images:
        raise UserError(f"data.path: {str(root)!r} holds no images; an imagefolder holds {LAYOUT}")
    return images


def check_class_folders(root: Path, images: list[Path]) -> None:
    """Every folder beside the class folders holds an image (an empty one would be a class never seen)."""
    classes = {image.parent for image in images}
    for split_root in sorted({c.parent for c in classes}):
        for folder in sorted(split_root.iterdir()):
            if folder.is_dir() and not folder.name.startswith(".") and folder not in classes:
                raise UserError(f"data.path: the class folder {folder} holds no image; add images to it or remove it")


def check_readable(image: Path) -> None:
    """Pillow recognises the file (its header only: a few bytes, not the pixels)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # Pillow warns above Image.MAX_IMAGE_PIXELS, and refuses above twice that
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(image):
                pass
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UserError(f"data.path: {image} is more pixels than Pillow opens ({first_line(e)}); shrink it, or remove it") from None
    except OSError as e:  # PIL.UnidentifiedImageError is one
        raise unreadable(image, e) from None


def unreadable(image: Path, e: OSError) -> UserError:
    from PIL import UnidentifiedImageError

    reason = "not a format it knows" if isinstance(e, UnidentifiedImageError) else first_line(e)  # its own message repeats the path
    return UserError(f"data.path: {image} is not an image Pillow can read ({reason}); remove or replace it")


def class_names(root: Path, splits: dict[str, list[Path]]) -> list[str]:
    """The class folder names of the train split, sorted: class id i is names[i], as datasets' ClassLabel numbers
    them. A validation class without training images is one line."""
    names = sorted({image.parent.name for image in splits["train"]})
    unknown = sorted({image.parent.name for image in splits.get("validation", [])} - set(names))
    if unknown:
        raise UserError(
            f"data.path: the class {unknown[0]!r} has validation images but no train/{unknown[0]}/ folder; add training images or remove it"
        )
    if len(names) < 2:
        raise UserError(f"data.path: {str(root)!r} has one class folder ({names[0]}); a classifier needs two or more ({LAYOUT})")
    return names


def fraction_split(images: list[Path], fraction: float) -> tuple[list[Path], list[Path]]:
    """(train, validation): data.val_fraction of the images, one fixed draw, each split in path order."""
    n_val = int(len(images) * fraction)
    if not 0 < n_val < len(images):
        raise UserError(
            f"data.val_fraction={fraction} of {len(images)} images leaves {n_val} for validation and {len(images) - n_val} "
            "for training; change data.val_fraction, or give validation images in a validation/ folder beside train/"
        )
    drawn = set(torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))[:n_val].tolist())
    return [f for i, f in enumerate(images) if i not in drawn], [f for i, f in enumerate(images) if i in drawn]


# ---------------------------------------------------------------- the pixels


def image_processor(model_cfg: Any) -> Any:
    """The model's image processor (model.hf_path's preprocessor_config.json, local files only), PIL backend."""
    path = getattr(model_cfg, "hf_path", "")
    if not path:
        raise UserError(
            f"model.task=image-classification takes its pixels from the image processor of model.hf_path ({PROCESSOR_FILE}); "
            f"model.name={model_cfg.name} has none: use model.name=hf with an image model's folder"
        )
    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / PROCESSOR_FILE).is_file():
        raise UserError(
            f"model.hf_path {path!r} has no {PROCESSOR_FILE} (the image processor that makes the model's pixel_values); save one "
            f"there, e.g. transformers.AutoImageProcessor.from_pretrained(NAME).save_pretrained({path!r})"
        )
    try:
        import transformers
    except ImportError:
        raise UserError(f"model.task=image-classification needs the transformers package: {INSTALL}") from None
    transformers.logging.set_verbosity_error()  # its advice would repeat on every rank
    try:
        # PIL, not torchvision: the same pixels on every machine, so a run resumed elsewhere sees the same images.
        return transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"model.hf_path {path!r}: could not load its image processor ({first_line(e)})") from None


class ImageSamples(Dataset):
    """Images and their class ids; a batch is {"pixel_values": (B, C, H, W) float, "labels": (B,) int64}, each
    image read and processed when its batch is drawn."""

    def __init__(self, files: list[Path], labels: list[int], processor: Any, shape: tuple[int, ...] | None = None):
        self.files, self.labels, self.processor, self.shape = files, torch.tensor(labels, dtype=torch.long), processor, shape

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        images = [self.read(i) for i in indices]
        try:
            pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        except (ValueError, RuntimeError):  # images of several sizes cannot be stacked
            pixels = None
        if pixels is None or (self.shape is not None and tuple(pixels.shape[1:]) != self.shape):
            raise UserError(
                f"the image processor of model.hf_path makes pixel_values of another size for {self.files[indices[0]]} or the "
                "images batched with it; give it a fixed size (size: height and width, or a crop_size) in its preprocessor_config.json"
            )
        return {"pixel_values": pixels, "labels": self.labels[torch.as_tensor(indices)]}

    def read(self, i: int) -> Any:
        """Image i in RGB (what image processors take; a grey or RGBA file is converted)."""
        from PIL import Image

        try:
            with Image.open(self.files[i]) as image:
                return image.convert("RGB")
        except OSError as e:
            raise unreadable(self.files[i], e) from None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
