"""The library and the command lines import without torch (it is only in the `parity` extra) and without
transformers (loaded lazily, only where a tokenizer is needed)."""

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import dflash_jax, infer
names = [m.name for p in (dflash_jax, infer) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')
         if not m.name.endswith('__main__')]
for name in names:
    importlib.import_module(name)
assert len(names) > 20, names
print('torch' in sys.modules, 'transformers' in sys.modules)
"""


def test_every_module_imports_without_torch_or_transformers():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
