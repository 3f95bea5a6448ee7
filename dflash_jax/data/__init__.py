"""Training data: sources (JSONL, JSON arrays, Parquet, Arrow, directories, globs, Hub datasets), conversation
and plain-text formats, regeneration of the answers by the target, tokenisation into padded rows with loss
masks (SPEC section 6), mixtures of sources and the tokenized cache."""

from dflash_jax.data.formats import (
    Conversation, DataError, Example, PlainText, ReadStats, example_to_row, read_examples,
)
from dflash_jax.data.regenerate import RegenerateStats, regenerate
from dflash_jax.data.tokenize import TokenizedData, encode_example, plain_prompt_ids, tokenize_examples

__all__ = [
    "Conversation", "DataError", "Example", "PlainText", "ReadStats", "RegenerateStats", "TokenizedData",
    "encode_example", "example_to_row", "plain_prompt_ids", "read_examples", "regenerate", "tokenize_examples",
]
