"""Tiny transformers models and a tokenizer, made here (no network): what the model.name=hf tests train.

Each model is 2 layers, 64 wide, with a vocabulary of 300 ids (>= 256, so data.tokenizer=byte fits too), saved
with save_pretrained into a folder, as a model from the Hub would be. The tokenizer is a byte-level BPE trained
with `tokenizers` on the shipped corpus and wrapped as a PreTrainedTokenizerFast.
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers import REPO

VOCAB = 300
EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int = VOCAB, chars: int | None = None):
    """A byte-level BPE of `vocab_size` ids trained on Tiny Shakespeare (its first `chars` characters: all of it by
    default), as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    text = (REPO / "data" / "tinyshakespeare.txt").read_text()[:chars]
    core.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS)


# What the tiny decoders share: 2 layers of 4 heads, untied, 128 positions.
DECODER = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
DECODER.update(bos_token_id=0, eos_token_id=0)


def llama_config(**overrides):
    from transformers import LlamaConfig

    settings = dict(DECODER, hidden_size=64, intermediate_size=128, num_key_value_heads=2)
    return LlamaConfig(**{**settings, **overrides})


def gpt2_config(**overrides):
    """GPT-2 ties lm_head to its token embedding; dropout off so that split and unsplit runs compare exactly."""
    from transformers import GPT2Config

    settings = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(**{**settings, "bos_token_id": 0, "eos_token_id": 0, **overrides})


# Mixtures of experts: 2 layers, 4 routed experts, 2 per token, 32 wide. save_pretrained writes each expert's tensors
# apart (Mixtral under its older block_sparse_moe names), which from_pretrained fuses on loading.
MOE_SIZES = dict(DECODER, hidden_size=32, intermediate_size=64, num_experts_per_tok=2)


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    settings = dict(MOE_SIZES, num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1)
    return Qwen3MoeConfig(**{**settings, **overrides})


def mixtral_config(**overrides):
    from transformers import MixtralConfig

    return MixtralConfig(**{**MOE_SIZES, "num_key_value_heads": 2, "num_local_experts": 4, **overrides})


def deepseek_v3_config(**overrides):
    """Multi-head latent attention, a shared expert beside the 4 routed ones, and a dense first layer."""
    from transformers import DeepseekV3Config

    experts = dict(n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    latent = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
    settings = dict(MOE_SIZES, **experts, **latent, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return DeepseekV3Config(**{**settings, **overrides})


MOE_CONFIGS = {"qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config, "deepseek_v3": deepseek_v3_config}


def save_model(config, folder: Path, tokenizer=None, seed: int = 0) -> Path:
    """A randomly initialised model of `config` saved as a model folder (config.json, model.safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def make_models(root: Path) -> dict[str, Path]:
    """{"llama": folder, "gpt2": folder}: each with weights and the trained tokenizer."""
    tokenizer = train_tokenizer()
    return {
        "llama": save_model(llama_config(), root / "llama", tokenizer),
        "gpt2": save_model(gpt2_config(), root / "gpt2", tokenizer),
    }


# ---------------------------------------------------------------- chat: a tokenizer with a chat template, conversations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen's templates write it; a role it does not know is refused, as many models' templates do.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same rendering, with the assistant's text marked by {% generation %} (transformers' assistant mask).
CHAT_TEMPLATE_MARKED = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}",
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' + '\n' }}"
    "{% endgeneration %}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endif %}",
)


def chat_tokenizer(vocab_size: int = VOCAB):
    """The byte-level BPE of train_tokenizer, with ChatML's two special tokens and its template; a turn ends with
    <|im_end|>, its end-of-sequence token (what generation stops at)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = (REPO / "data" / "tinyshakespeare.txt").read_text()
    core.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, bos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE)


def make_chat_model(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer has a chat template (an "instruct" model folder)."""
    return save_model(llama_config(), folder, chat_tokenizer(), seed=seed)


def chat_files(tmp: Path) -> dict:
    """{"model": a tiny chat Llama folder, "rows": a jsonl of 60 one- or two-exchange conversations, "tmp": tmp}."""
    import json

    folder = make_chat_model(tmp / "chat_llama")
    rows = tmp / "chats.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in conversations(60, turns=2)))
    return {"model": folder, "rows": rows, "tmp": tmp}


def conversations(n: int, seed: int = 0, turns: int = 3) -> list[dict]:
    """n rows {"messages": [...]}: a system line, then `turns` user/assistant exchanges of Shakespeare's lines."""
    import random

    lines = [line for line in (REPO / "data" / "tinyshakespeare.txt").read_text().splitlines() if len(line) > 20]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Answer in verse."}]
        for _ in range(rng.randint(1, turns)):
            messages += [{"role": "user", "content": rng.choice(lines)}, {"role": "assistant", "content": " ".join(rng.sample(lines, 2))}]
        rows.append({"messages": messages})
    return rows


# ---------------------------------------------------------------- a BERT-style WordPiece tokenizer

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def bert_tokenizer(texts: list[str] | None = None, vocab_size: int = 120):
    """A WordPiece tokenizer as BERT's (a `tokenizers.Tokenizer`): [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then
    pieces trained on `texts` (Tiny Shakespeare's first lines by default), so that words split into sub-words
    (`##...`); its post-processor writes [CLS] a [SEP] and [CLS] a [SEP] b [SEP], with type ids 0 then 1, as BERT's
    tokenizer.json does. Save it with `.save(folder / "tokenizer.json")`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    texts = texts or (REPO / "data" / "tinyshakespeare.txt").read_text().splitlines()[:2000]
    core.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS), show_progress=False)
    )
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return core


# ---------------------------------------------------------------- the other tasks: a BERT, a T5, a ViT

LABELS = ["negative", "positive", "neutral"]  # the classifiers' class names (id2label)


def bert_config(**overrides):
    """An encoder (sequence and token classification, masked LM); dropout off so that layouts compare exactly."""
    from transformers import BertConfig

    settings = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    return BertConfig(**{**settings, **overrides})


def t5_config(**overrides):
    """An encoder-decoder (seq2seq): its embedding is shared by encoder, decoder and lm_head."""
    from transformers import T5Config

    settings = dict(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return T5Config(**{**settings, **overrides})


def vit_config(**overrides):
    """A vision transformer (image classification) on 16 x 16 images in 8 x 8 patches."""
    from transformers import ViTConfig

    settings = dict(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ViTConfig(**{**settings, **overrides})


def resnet_config(**overrides):
    """A ResNet (image classification, cv_example's family: a CNN, no attention) of two basic stages, 8 and 16 wide."""
    from transformers import ResNetConfig

    settings = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return ResNetConfig(**{**settings, **overrides})


def roberta_config(**overrides):
    """A RoBERTa (masked LM, mlm_example's family), padding id 0 as the WordPiece tokenizer above has it; dropout off."""
    from transformers import RobertaConfig

    settings = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=80,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return RobertaConfig(**{**settings, **overrides})


def save_task_model(config, auto_class: str, folder: Path, tokenizer=None, seed: int = 0) -> Path:
    """A randomly initialised `auto_class` model of `config` saved as a model folder (an image model's with its image
    processor: a ViT's resizes to 16 x 16, a ResNet's as microsoft/resnet-50's, shortest edge then a centre crop of 16)."""
    import transformers

    torch.manual_seed(seed)
    getattr(transformers, auto_class).from_config(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if config.model_type == "vit":
        transformers.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(folder)
    if config.model_type == "resnet":
        transformers.ConvNextImageProcessorPil(size={"shortest_edge": 16}, crop_pct=0.875).save_pretrained(folder)
    return folder


def make_task_models(root: Path) -> dict[str, Path]:
    """{"bert": a BERT with its masked-LM head (a pretrained body: every classifier head is new),
    "bert-classifier": a BERT classifier of LABELS, "t5": a T5, "vit": a ViT classifier of LABELS}."""
    tokenizer = train_tokenizer(chars=100_000)  # a tenth of the corpus: ids are all these models need
    tokenizer.pad_token = EOS
    labels = dict(num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
    return {
        "bert": save_task_model(bert_config(), "AutoModelForMaskedLM", root / "bert", tokenizer),
        "bert-classifier": save_task_model(bert_config(**labels), "AutoModelForSequenceClassification", root / "bert_cls", tokenizer),
        "t5": save_task_model(t5_config(), "AutoModelForSeq2SeqLM", root / "t5", tokenizer),
        "vit": save_task_model(vit_config(**labels), "AutoModelForImageClassification", root / "vit"),
    }
