"""``python -m train``: the command line over ``dflash_jax.data`` and ``dflash_jax.training``."""
