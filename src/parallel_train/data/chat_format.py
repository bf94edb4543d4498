"""Conversations as token ids plus the mask of the tokens a model learns to write, by the tokenizer's chat template.

    data.format=chat         rows with a list of messages ({"role": ..., "content": ...}, data.messages_column)
    data.format=instruction  rows with a prompt and a completion (data.prompt_column, data.completion_column): a
                             user turn and an assistant turn through the chat template, or, for a tokenizer without
                             one, the prompt followed by the completion and the end-of-text token

The template is the tokenizer's own, as transformers renders it (`apply_chat_template`): the chat_template of the
model folder (or Hub tokenizer, or run folder) that data.tokenizer names, or the jinja file data.chat_template
names instead. Only what the assistant says is learned: its tokens keep their targets, every other token's target
is -100 (losses.py). Which tokens are the assistant's:
- a template that marks them with `{% generation %}...{% endgeneration %}` says so itself (transformers'
  `return_assistant_tokens_mask`);
- otherwise each assistant turn is the text the conversation gains from the prompt that asks for it
  (`add_generation_prompt=True`) to the end of that turn: its content and the template's end-of-turn marker, which
  the model must learn to stop. Templates that rewrite earlier turns once later ones exist cannot be read this
  way: a one-line error asks for a template with `{% generation %}`.
Spans are found in the rendered text and mapped to tokens through the tokenizer's character offsets, so a token
merged across a border still belongs to one side.

The template travels with the run (`files()`: chat_template.jinja and tokenizer_config.json beside the run's
tokenizer.json, so that `AutoTokenizer.from_pretrained(run)` renders as training did; scripts/sample.py --chat
uses it). transformers is needed here (requirements-hf.txt); nothing else in the template imports this module.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

FILES = ("chat_template.jinja", "tokenizer_config.json")  # what save_pretrained writes beside tokenizer.json
LOAD_TIME_KEYS = ("local_files_only", "is_local")  # what transformers writes about how a tokenizer was loaded
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # {% generation %}: the template marks the assistant's text


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def hf_tokenizer(spec: str, core: Any) -> Any:
    """The transformers tokenizer of a data.tokenizer spec: the folder's (or Hub repository's) own, with its special
    tokens and chat template, when there is one; else the `tokenizers` core alone, without a template."""
    from parallel_train.models.hf_loading import import_transformers

    transformers = import_transformers()
    folder = Path(spec).expanduser()
    with_config = folder.is_dir() and (folder / "tokenizer_config.json").is_file()
    hub_name = not folder.exists() and spec.count("/") <= 1 and ":" not in spec  # not char, byte, bpe:N, word
    if with_config or (hub_name and spec not in ("char", "byte", "word")):
        try:
            return transformers.AutoTokenizer.from_pretrained(str(folder) if with_config else spec)
        except (OSError, ValueError):  # a Hub tokenizer without a config, or offline: its tokenizer.json alone
            pass
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core)


@dataclass
class ChatFormat:
    """Renders rows of one format (data.format) into (ids, mask) with one transformers tokenizer."""

    tokenizer: Any  # transformers tokenizer whose ids are the run's (the same tokenizer.json); None: no template
    kind: str  # chat | instruction
    columns: tuple[str, ...]  # the row's columns this format reads: (messages,) or (prompt, completion)
    run_tokenizer: Any = None  # the run's (data/tokenizers.py): encodes plain prompt + completion samples, and its eot ends them

    @property
    def template(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.chat_template

    @property
    def marks_answers(self) -> bool:
        return self.template is not None and GENERATION_TAG.search(self.template) is not None

    @property
    def eot(self) -> int | None:
        return getattr(self.run_tokenizer, "eot", None)

    def describe(self) -> str:
        if self.template is None:
            return f"{self.kind} rows as {' + '.join(self.columns)} + end-of-text (the tokenizer has no chat template)"
        how = "{% generation %} marks" if self.marks_answers else "the text each assistant turn adds"
        return f"{self.kind} rows rendered by the chat template; loss on the assistant's tokens ({how})"

    def messages(self, row: dict[str, Any], where: str) -> list[dict[str, Any]]:
        """The conversation of one row; a malformed row is a one-line error naming `where` it is."""
        if self.kind == "instruction":
            prompt, completion = (row.get(c) for c in self.columns)
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UserError(f"data.path: {where} has no text in {self.columns[0]!r} and {self.columns[1]!r}")
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        messages = row.get(self.columns[0])
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        ):
            raise UserError(
                f'data.path: {where} has no messages in {self.columns[0]!r} (a list of {{"role": ..., "content": ...}}); '
                "fix the row, or name the column with data.messages_column"
            )
        return messages

    def render(self, row: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, mask: True where the token is one the model learns to write)."""
        messages = self.messages(row, where)
        if self.template is None:  # instruction rows of a tokenizer without a template
            return self._plain(messages[0]["content"], messages[1]["content"])
        try:
            if self.marks_answers:
                out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=bool)
            text, spans = self._assistant_spans(messages, where)
        except UserError:
            raise
        except Exception as e:  # jinja2's TemplateError (a role it does not know: raise_exception), and the like
            raise UserError(f"data.path: {where}: the chat template refused it ({_first_line(e)})") from None
        return self._tokens(text, spans)

    def _assistant_spans(self, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        render = self.tokenizer.apply_chat_template
        text = render(messages, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            asked, answered = render(messages[:i], tokenize=False, add_generation_prompt=True), render(messages[: i + 1], tokenize=False)
            if not (answered.startswith(asked) and text.startswith(answered)):
                raise UserError(
                    f"data.path: {where}: the chat template renders earlier turns differently once later ones follow, so the "
                    "assistant's tokens cannot be found; give data.chat_template=FILE with {% generation %}...{% endgeneration %} "
                    "around the assistant's text"
                )
            spans.append((len(asked), len(answered)))
        return text, spans

    def _tokens(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for lo, hi in spans:
            mask |= (starts >= lo) & (starts < hi)
        return np.asarray(enc["input_ids"], dtype=np.int64), mask

    def _plain(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """The prompt, the completion and the end-of-text token (a newline for char and byte), the last two learned."""
        end = [self.eot] if self.eot is not None else [int(i) for i in self.run_tokenizer.encode("\n")]
        ids = [[int(i) for i in self.run_tokenizer.encode(t)] for t in (prompt, completion)]
        mask = [False] * len(ids[0]) + [True] * (len(ids[1]) + len(end))
        return np.asarray(ids[0] + ids[1] + end, dtype=np.int64), np.asarray(mask, dtype=bool)

    def prompt(self, question: str) -> list[int]:
        """A one-question conversation up to the assistant's turn, for generation (scripts/sample.py --chat)."""
        if self.template is None:
            return [int(i) for i in self.run_tokenizer.encode(question)]
        messages = [{"role": "user", "content": question}]
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    def stop_ids(self) -> set[int]:
        """The ids that end the assistant's answer: the tokenizer's end-of-sequence token (and end-of-text)."""
        ids = {getattr(self.tokenizer, "eos_token_id", None), self.eot}
        return {i for i in ids if i is not None}

    def files(self) -> dict[str, str]:
        """The tokenizer's config and template as files (name -> text) to save beside the run's tokenizer.json."""
        if self.tokenizer is None:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            files = {name: (Path(tmp) / name).read_text(encoding="utf-8") for name in FILES if (Path(tmp) / name).is_file()}
        if "tokenizer_config.json" in files:  # how it was loaded (HF_HUB_OFFLINE, ...) is not the tokenizer's: same bytes everywhere
            config = {k: v for k, v in json.loads(files["tokenizer_config.json"]).items() if k not in LOAD_TIME_KEYS}
            files["tokenizer_config.json"] = json_text(config, indent=2) + "\n"
        return files


def load_format(kind: str, spec: str, core: Any, run_tokenizer: Any, template_file: str = "", columns: tuple[str, ...] = ()) -> ChatFormat:
    """The format `kind` with the tokenizer `spec` names (its `tokenizers` core: `core`; None for char and byte,
    which only plain instruction rows take), its chat template or the one in `template_file`. Chat rows need a
    template: without one, a one-line error."""
    if core is None:
        return ChatFormat(None, kind, columns, run_tokenizer)
    tokenizer = hf_tokenizer(spec, core)
    if template_file:
        path = Path(template_file).expanduser()
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"data.chat_template: cannot read {template_file!r} ({_first_line(e)})") from None
    if kind == "chat" and tokenizer.chat_template is None:
        raise UserError(
            f"data.format=chat: the tokenizer {spec!r} has no chat template; give one with data.chat_template=FILE "
            "(a jinja template, as in a model's tokenizer_config.json or chat_template.jinja)"
        )
    if isinstance(tokenizer.chat_template, dict):  # several named templates: the default one
        tokenizer.chat_template = tokenizer.chat_template.get("default") or next(iter(tokenizer.chat_template.values()))
    return ChatFormat(tokenizer, kind, columns, run_tokenizer)


def from_folder(folder: Path, run_tokenizer: Any) -> ChatFormat:
    """The chat format a run (or checkpoint, or prepared folder) saved, for scripts/sample.py --chat: its template
    (tokenizer_config.json, chat_template.jinja), or none (prompts are then plain text)."""
    if not (folder / "tokenizer_config.json").is_file():
        return ChatFormat(None, "chat", ("messages",), run_tokenizer)
    from parallel_train.models.hf_loading import import_transformers

    tokenizer = import_transformers().AutoTokenizer.from_pretrained(str(folder))
    return ChatFormat(tokenizer, "chat", ("messages",), run_tokenizer)
