"""``python -m infer``: the command line over ``dflash_jax.engine`` (generate, bench, speed, convert, demo)."""
