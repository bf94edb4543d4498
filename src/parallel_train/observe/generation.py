"""Generate text from a trained run: load its weights, config and vocabulary, then sample token by token.

Weights are saved with the unsplit model's parameter names whatever the topology (DDP, FSDP, pipeline),
so a run from any launch loads into the plain model built from its config.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.export import load_weights, read_weights
from parallel_train.config.load import config_from_dict
from parallel_train.config.sections import Config
from parallel_train.data.tokenizers import HF_FILE, VOCAB_FILE, load_saved
from parallel_train.errors import UserError
from parallel_train.models import build_model


@dataclass
class Trained:
    model: nn.Module
    vocab: Any  # the run's tokenizer (data/tokenizers.py): encode(str) -> ids, decode(ids) -> str
    cfg: Config
    source: Path  # the weights file it came from


def _weights_folder(run: Path | None, ckpt: Path | None) -> Path:
    """The folder holding model.safetensors: the checkpoint if given, else the run folder."""
    if ckpt is not None:
        if not ckpt.is_dir():
            raise UserError(f"--checkpoint {ckpt}: no such folder (give a checkpoints/step_* folder)")
        problem = checkpointer.verify(ckpt)
        if problem:
            raise UserError(f"--checkpoint {ckpt}: not a valid checkpoint ({problem})")
        return ckpt
    assert run is not None
    if not run.is_dir():
        raise UserError(f"--run {run}: no such folder (give the output_dir of a training run)")
    if not (run / "model.safetensors").is_file():
        newest = checkpointer.list_checkpoints(run / "checkpoints")
        hint = f"; sample from a checkpoint with --checkpoint {newest[-1]}" if newest else ""
        raise UserError(f"--run {run}: no model.safetensors (the run has not finished){hint}")
    return run


def _run_file(name: str, *folders: Path | None) -> Path:
    for folder in folders:
        if folder is not None and (folder / name).is_file():
            return folder / name
    raise UserError(f"no {name} in {' or '.join(str(f) for f in folders if f is not None)}; is it the output_dir of a training run?")


def load_trained(run: Path | None, ckpt: Path | None = None, device: str = "cpu") -> Trained:
    """Build the run's model from its config.yaml and load its final weights (or a checkpoint's)."""
    folder = _weights_folder(run, ckpt)
    cfg_path = _run_file("config.yaml", folder, run)
    try:
        cfg = config_from_dict(yaml.safe_load(cfg_path.read_text()) or {})
    except UserError as e:
        raise UserError(f"{cfg_path}: {e}") from None
    if cfg.model.task != "causal-lm":  # a classifier, a tagger, a masked LM or a seq2seq model predicts no next token
        raise UserError(
            f"{cfg_path}: this run trained model.task={cfg.model.task}: scripts/sample.py generates text from model.task=causal-lm "
            "runs only (it continues a prompt token by token); load this run's hf/ folder with transformers instead"
        )
    if cfg.data.path in ("random", "synthetic"):
        raise UserError(f"{cfg_path}: this run trained on data.path={cfg.data.path}, which has no text to sample")
    vocab = next((t for t in (load_saved(f) for f in (folder, run) if f is not None) if t is not None), None)
    if vocab is None:
        _run_file(f"{HF_FILE} or {VOCAB_FILE}", folder, run)  # raises: names where it looked
    model = build_model(cfg.model, max(vocab.size, cfg.model.vocab_size))
    weights = folder if ckpt is not None else folder / "model.safetensors"
    try:  # a checkpoint holds each rank's part: assembled whole here (checkpoint/export.py); a tied weight's alias restored
        model.load_state_dict(load_weights(folder) if ckpt is not None else read_weights(weights))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise UserError(f"{weights} does not fit model.name={cfg.model.name} built from {cfg_path} ({first})") from None
    return Trained(model.to(device).eval(), vocab, cfg, weights)


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop: set[int] | frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Append max_new_tokens sampled ids to ids (1, T), or fewer: up to and including the first id in `stop` (the
    end of an answer); the model sees at most the last block_size ids."""
    for _ in range(max_new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :].float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        next_id = torch.multinomial(probs.cpu(), 1, generator=generator).to(ids.device)
        ids = torch.cat([ids, next_id], dim=1)
        if int(next_id[0, 0]) in stop:
            break
    return ids


def chat_answer(trained: Trained, folder: Path, question: str, max_new_tokens: int, **sampling: Any) -> str:
    """The run's answer to one question, its prompt rendered by the chat template the run trained with (saved
    beside its tokenizer; data/chat_format.py), sampled until the end-of-turn token; the answer only, without it."""
    from parallel_train.data.chat_format import from_folder

    fmt = from_folder(folder, trained.vocab)
    prompt = fmt.prompt(question)
    device = next(trained.model.parameters()).device
    out = generate(
        trained.model, torch.tensor([prompt], device=device), max_new_tokens, trained.cfg.model.block_size, stop=fmt.stop_ids(), **sampling
    )
    answer = out[0, len(prompt) :].tolist()
    return trained.vocab.decode(answer[:-1] if answer and answer[-1] in fmt.stop_ids() else answer)


def encode_prompt(vocab: Any, prompt: str) -> list[int]:
    """The prompt's ids; an empty prompt starts from a newline (or id 0 if the vocab has none)."""
    if not prompt:
        try:
            return [int(i) for i in vocab.encode("\n")]
        except ValueError:
            return [0]
    try:
        return [int(i) for i in vocab.encode(prompt)]
    except ValueError:
        missing = sorted({c for c in prompt if c not in getattr(vocab, "chars", prompt)})
        raise UserError(
            f"--prompt: the characters {''.join(missing)!r} are not in this run's vocabulary; use characters from its corpus"
        ) from None
