"""The project's one error type for failures the user can fix.

A bad file, config value, argument or prompt raises ``UserError`` (or a subclass naming its domain:
``ConfigError``, ``CheckpointError``, ``DataError``) with a message that names the file, key or value. The
command-line tools print exactly these as one ``error: ...`` line with exit code 2. Anything else is a bug or
an environment failure and keeps its traceback. It subclasses ``ValueError`` so that library callers who
catch ``ValueError`` keep working.
"""


class UserError(ValueError):
    """A failure caused by the user's input; the message says which input and how to fix it."""


class ServingWarning(UserWarning):
    """Something that runs here but will not run the same elsewhere (e.g. a draft SGLang/vLLM cannot serve).
    The command-line tools print it as one ``warning: ...`` line."""
