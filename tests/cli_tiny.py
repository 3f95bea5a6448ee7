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
