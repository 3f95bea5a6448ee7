"""A tiny Hugging Face target directory with a real (character-level) tokenizer and chat template, plus a
tiny official draft directory, written without torch: what a user would point ``python -m infer`` at."""

from __future__ import annotations

import json
import string
from pathlib import Path

from dflash_jax.checkpoints.hf_target import save_target
from dflash_jax.checkpoints.official_draft import save_draft
from engine_tiny import tiny_draft, tiny_target

SPECIALS = ["<unk>", "<s>", "</s>"]
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"][: 97 - len(SPECIALS)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def write_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Fuse()  # characters decode back to the exact text (no spaces between tokens)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


HARMONY_LIKE = (  # what gpt-oss's template does with these messages (tools left out)
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if '<|channel|>' in m.content %}{{- raise_exception('channel tags in the content field') }}{%- endif %}"
    "{%- if loop.last and not add_generation_prompt %}"
    "{%- if m.thinking is defined %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)


def write_harmony_tokenizer(out: Path) -> None:
    """A character tokenizer with harmony's special tokens and a template that renders messages as gpt-oss's
    does (``HARMONY_LIKE``), saved to ``out``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    chars = sorted(set(CHARS) | {" ", "\n"})
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", unk_token="<unk>",
                                   additional_special_tokens=specials[1:5])
    fast.chat_template = HARMONY_LIKE
    fast.save_pretrained(out)


def write_tiny_pair(root: Path, block: int = 8) -> tuple[Path, Path]:
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=block)
    target_dir, draft_dir = root / "target", root / "draft"
    save_target(tc, tp, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=2)
    (target_dir / "config.json").write_text(json.dumps(config))
    write_tokenizer(target_dir)
    save_draft(dc, dp, draft_dir)
    return target_dir, draft_dir
