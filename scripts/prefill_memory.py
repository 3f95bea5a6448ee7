"""AOT memory of the engine's prefill at the Qwen3-8B shapes (docs/results-cpu.md, "Attention bounded by the live length"): compiles the
prefill program from abstract shapes (no weights, nothing runs) for a batch of one prompt of each length and
prints XLA's memory analysis. On a CPU this is XLA:CPU's accounting, a proxy for an accelerator's.

    python scripts/prefill_memory.py [--lengths 4096,16384,32768] [--max-new-tokens 2048] [--preset qwen3-8b]
"""

import argparse

import jax
import jax.numpy as jnp

from dflash_jax.checkpoints.hf_target import abstract_target_params
from dflash_jax.checkpoints.official_draft import abstract_draft_params
from dflash_jax.engine.generate import DecodeSettings, cache_slots, jitted_functions, prompt_width
from dflash_jax.engine.proposers import DFlashProposer
from dflash_jax.evaluation.speed import preset_configs
from dflash_jax.models.draft import shared_head

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384,32768", help="prompt lengths (comma-separated)")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="answer budget (sets the cache size)")
    parser.add_argument("--preset", default="qwen3-8b", help="shape preset of python -m infer speed")
    args = parser.parse_args()
    dtype = jnp.bfloat16
    tc, dc = preset_configs(args.preset)
    tc = type(tc)(**{**tc.__dict__, "max_position_embeddings": max(tc.max_position_embeddings, 65536)})
    target = abstract_target_params(tc, dtype)
    draft = abstract_draft_params(dc, dtype)
    prop = DFlashProposer(dc, dc.block_size, dtype)
    settings = DecodeSettings(args.max_new_tokens)
    print(f"{args.preset}: target {tc.num_hidden_layers} layers, hidden {tc.hidden_size}, bf16; draft "
          f"{dc.num_hidden_layers} layers, block {dc.block_size}; max_new_tokens {args.max_new_tokens}; batch 1")
    print("| prompt tokens | cache slots | params GiB | KV caches GiB | temporaries GiB | total GiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in (int(x) for x in args.lengths.split(",")):
        slots = cache_slots(length, args.max_new_tokens, dc.block_size, tc.max_position_embeddings)
        width = prompt_width(length, args.max_new_tokens, tc.max_position_embeddings)
        consts, state = jax.eval_shape(lambda: prop.init(draft, shared_head(target, tc.tie_word_embeddings), 1,
                                                         slots))
        pre, _ = jitted_functions(tc, prop, settings, slots, dtype)
        tokens = jax.ShapeDtypeStruct((1, width), jnp.int32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        compiled = pre.lower(target, consts, state, tokens, lengths, jax.random.PRNGKey(0)).compile()
        mem = compiled.memory_analysis()
        params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((target, draft)))
        out = int(mem.output_size_in_bytes)
        total = int(mem.argument_size_in_bytes) + out + int(mem.temp_size_in_bytes) - int(mem.alias_size_in_bytes)
        print(f"| {length} | {slots} | {params / GIB:.1f} | {out / GIB:.1f} | {mem.temp_size_in_bytes / GIB:.1f} "
              f"| {total / GIB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
