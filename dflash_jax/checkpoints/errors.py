"""The checkpoint layer's error type, in a module of its own so that every checkpoint module can raise it
(``safetensors_io`` reads the tensors that ``quantized`` decodes: neither may import the other for it)."""

from dflash_jax.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the key."""
