"""safetensors directories <-> nested parameter dicts.

Parameter paths mirror Hugging Face key names, so the mapping is mechanical: ``layers_3/self_attn/q_proj/kernel``
is ``layers.3.self_attn.q_proj.weight`` stored transposed (PyTorch linear weights are ``[out, in]``), and
``embed_tokens/embedding`` is ``embed_tokens.weight``. Only safetensors are read: pickle-based ``.bin``/``.pt``
weights can execute code on load and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from dflash_jax.checkpoints import quantized
from dflash_jax.checkpoints.errors import CheckpointError  # noqa: F401  (re-exported: imported from here)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Stored dtypes read from raw bytes (safetensors' numpy reader has no numpy dtype for them): ml_dtypes names.
RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
DTYPE_NAMES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def param_path_to_key(path: tuple[str, ...]) -> tuple[str, bool]:
    """``('layers_0', 'mlp', 'up_proj', 'kernel')`` -> ``('layers.0.mlp.up_proj.weight', transpose=True)``."""
    parts = [re.sub(r"^(layers)_(\d+)$", r"\1.\2", p) for p in path[:-1]]
    leaf = path[-1]
    transpose = leaf == "kernel"
    parts.append({"kernel": "weight", "embedding": "weight"}.get(leaf, leaf))
    return ".".join(parts), transpose


def flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, v in flat.items():
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = v
    return out


class SafetensorsDir:
    """Index of a safetensors checkpoint: a single ``.safetensors`` file, a directory holding
    ``model.safetensors``, or a sharded directory with ``model.safetensors.index.json``.

    A directory whose ``config.json`` declares a ``quantization_config`` (``checkpoints/quantized``: block-scaled
    FP8, compressed-tensors INT4) is read dequantised: ``get``, ``shape`` and ``dtype_name`` describe every
    quantised weight as the float tensor it stands for (``dequantize_dtype``), one tensor at a time, so every
    loader reads it like a float checkpoint; ``get_stored`` and the ``stored_*`` methods see the file as it is.
    ``dequantize=False`` reads the stored tensors only (and ignores the config)."""

    def __init__(self, path: str | Path, dequantize: bool = True):
        self.path = Path(path)
        self.key_to_file: dict[str, Path] = {}
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise CheckpointError(f"{self.path}: only .safetensors weights are accepted")
            files = [self.path]
        elif self.path.is_dir():
            files = self._files_of_dir()
        else:
            raise CheckpointError(f"{self.path}: checkpoint not found")
        for f in files:
            try:
                with safe_open(str(f), framework="numpy") as handle:
                    for key in handle.keys():
                        self.key_to_file[key] = f
            except Exception as e:  # safetensors raises several types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        #: The dtype quantised weights are dequantised to (``get``); a loader that casts every float param to
        #: one dtype anyway may set it to that dtype to halve the host memory of stacked experts.
        self.dequantize_dtype: Any = np.float32
        self.quantization = None
        self._int4: dict[str, str] = {}  # virtual "<m>.weight" -> its stored "<m>.weight_packed"
        if dequantize and self.path.is_dir():
            self._read_quantization()

    def _read_quantization(self) -> None:
        """``config.json``'s ``quantization_config`` (``checkpoints/quantized``): FP8 weights are dequantised
        by ``get``; compressed-tensors INT4 weights appear under their float name ``<m>.weight``."""
        self.quantization = quantized.scheme_of_dir(self.path)
        if isinstance(self.quantization, quantized.Int4Scheme):
            for weight, packed in quantized.virtual_int4_keys(list(self.key_to_file)).items():
                if weight in self.key_to_file:
                    raise CheckpointError(f"{self.key_to_file[weight]}: tensor {weight!r} is stored both as a float "
                                          f"weight and packed ({packed!r})")
                self._int4[weight] = packed
                self.key_to_file[weight] = self.key_to_file[packed]

    def _files_of_dir(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({type(e).__name__}: {e})") from None
            if not isinstance(weight_map, dict) or not weight_map or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file "
                                      f"name, got {str(weight_map)[:80]!r}")
            for name in set(weight_map.values()):
                # Shards are bare file names next to the index: a path could read any file on the machine.
                # (Checked lexically, not by resolving: hub caches store shards as symlinks into a blob store.)
                if Path(name).name != name or name in (".", ".."):
                    raise CheckpointError(f"{index}: shard {name!r} is not a file name inside {self.path}")
            files = sorted({self.path / name for name in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
            return files
        single = self.path / SINGLE_FILE
        if single.is_file():
            return [single]
        others = sorted(self.path.glob("*.safetensors"))
        if others:
            return others
        pickled = [n for n in PICKLE_NAMES if (self.path / n).exists()]
        if pickled or list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise CheckpointError(
                f"{self.path}: only pickle-based weights found ({', '.join(pickled) or '*.bin/*.pt'}); these can "
                "run code when loaded and are refused. Convert them to safetensors first."
            )
        raise CheckpointError(f"{self.path}: no .safetensors weights found")

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def file_of(self, key: str) -> Path:
        return self.key_to_file[key]

    def is_quantized(self, key: str) -> bool:
        """Whether ``get(key)`` dequantises (an FP8 weight, or a packed INT4 one under its float name)."""
        if key in self._int4:
            return True
        return (isinstance(self.quantization, quantized.Fp8Scheme)
                and self.stored_dtype_name(key) in quantized.FP8_WEIGHT_DTYPES)

    def get(self, key: str) -> np.ndarray:
        """The tensor ``key``; a quantised weight comes dequantised, as ``dequantize_dtype``."""
        if self.quantization is not None and self.is_quantized(key):
            if key in self._int4:
                return quantized.dequantize_int4(self, key, self.quantization, self.dequantize_dtype)
            return quantized.dequantize_fp8(self, key, self.quantization, self.dequantize_dtype)
        return self.get_stored(key)

    def get_stored(self, key: str) -> np.ndarray:
        """The tensor as stored. Dtypes numpy has no name for in safetensors' reader (FP8: ``F8_E4M3``,
        ``F8_E5M2``, ``F8_E8M0``) are read from the raw bytes as ml_dtypes arrays."""
        dtype = self.stored_dtype_name(key)
        if dtype in RAW_DTYPES:
            return self._raw(key, dtype)
        f = self.key_to_file[key]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="numpy")
        return self._handles[f].get_tensor(key)

    def _raw(self, key: str, dtype: str) -> np.ndarray:
        import ml_dtypes  # installed with jax

        f = self.key_to_file[key]
        if f not in self._headers:
            with open(f, "rb") as handle:
                n = int.from_bytes(handle.read(8), "little")
                self._headers[f] = (8 + n, json.loads(handle.read(n)))
        start, header = self._headers[f]
        entry = header[key]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        data = np.fromfile(f, dtype=np.uint8, count=end - begin, offset=start + begin)
        if data.size != int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{f}: tensor {key!r} holds {data.size} bytes for shape {list(shape)}")
        return data.view(getattr(ml_dtypes, RAW_DTYPES[dtype])).reshape(shape)

    def _slice(self, key: str) -> Any:
        f = self.key_to_file[key]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="numpy")
        return self._handles[f].get_slice(key)

    def stored_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def stored_dtype_name(self, key: str) -> str:
        """The stored dtype as safetensors names it (``F32``, ``BF16``, ``F8_E4M3``, ``I8``, ``BOOL``, ...)."""
        return str(self._slice(key).get_dtype())

    def describe(self, key: str) -> str:
        """``key`` quoted, and for a packed INT4 weight the tensors that stand for it (for messages)."""
        if key in self._int4:
            return f"{key!r} (stored packed as {self._int4[key]!r}, its shape in {key + '_shape'!r})"
        return repr(key)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``get(key)`` (a packed INT4 weight's from its ``weight_shape``)."""
        if key in self._int4:
            return quantized.int4_weight_shape(self, key)
        return self.stored_shape(key)

    def dtype_name(self, key: str) -> str:
        """The dtype of ``get(key)`` as safetensors names it: the stored one, or ``dequantize_dtype``'s for a
        quantised weight."""
        if self.quantization is not None and self.is_quantized(key):
            return DTYPE_NAMES[np.dtype(self.dequantize_dtype).name]
        return self.stored_dtype_name(key)


@dataclasses.dataclass(frozen=True)
class Derived:
    """A parameter built from stored tensors by more than a transpose (stacked per-expert weights, a fused
    gate/up split, MXFP4 blocks and scales decoded): ``build(arrays) -> param`` from ``keys`` in order, each
    with its expected stored ``shapes`` (checked from the header before any data is read) and dtype class
    (``"float"``, ``"uint8"``, or ``"raw"``: any dtype, checked by ``read``). ``name`` is what an error calls
    the parameter. ``read(key)``: how to read one tensor (default ``SafetensorsDir.get``, which dequantises)."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    build: Callable[[list[np.ndarray]], np.ndarray]
    dtypes: tuple[str, ...] = ()  # per key; empty = all "float"
    name: str = ""
    read: Callable[[str], np.ndarray] | None = None


def _check_stored(source: "SafetensorsDir", key: str, want: tuple[int, ...], kind: str) -> None:
    stored_shape = source.shape(key)
    if stored_shape != tuple(want):
        raise CheckpointError(f"{source.file_of(key)}: tensor {source.describe(key)} has shape {list(stored_shape)}, "
                              f"expected {list(want)}")
    if kind == "raw":  # the rule's reader checks the dtype
        return
    stored_dtype = source.dtype_name(key)
    allowed = FLOAT_DTYPES if kind == "float" else ("U8",)
    if stored_dtype not in allowed:  # casting integers or booleans would make a silently wrong model
        what = "weights must be floating point" if kind == "float" else "MXFP4 blocks and scales must be uint8"
        raise CheckpointError(f"{source.file_of(key)}: tensor {key!r} is stored as {stored_dtype}; {what} "
                              f"({', '.join(allowed)}){_quantized_hint(stored_dtype)}")


def _quantized_hint(stored_dtype: str) -> str:
    if stored_dtype == "F8_E4M3":
        return ("; FP8 weights are read when config.json's quantization_config says quant_method 'fp8' "
                "(with weight_scale_inv scales)")
    if stored_dtype.startswith("F8_"):
        return "; FP8 weights must be e4m3 (float8_e4m3fn), with quant_method 'fp8' in config.json"
    return ""


def load_params(
    source: SafetensorsDir,
    abstract_params: Mapping[str, Any],
    key_of: Callable[[tuple[str, ...]], "str | Derived"],
    dtype: Any = None,
    progress: bool = False,
    place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """Fill the tree of ``abstract_params`` (shapes from ``jax.eval_shape``) from ``source``.

    ``key_of(path)`` names the stored key of a param path. Every param must be present with the right
    shape; the error names the key, the file and both shapes. ``dtype=None`` keeps the stored dtype.
    ``place(path, host_array)`` makes the device array (default: one array on the default device); a sharded
    loader passes one that hands each device only its slice.
    """
    flat = flatten(abstract_params)
    out: dict[tuple[str, ...], Any] = {}
    missing = []
    # delay: small checkpoints load before a bar would be worth showing.
    for path, leaf in tqdm(flat.items(), desc=f"loading {source.path.name}", disable=not progress, unit="tensor",
                           delay=2.0):
        key = key_of(path)
        if isinstance(key, Derived):
            absent = [k for k in key.keys if k not in source.key_to_file]
            if absent:
                missing.extend(absent)
                continue
            for k, shape, kind in zip(key.keys, key.shapes, key.dtypes or ("float",) * len(key.keys)):
                _check_stored(source, k, shape, kind)
            arr = np.asarray(key.build([(key.read or source.get)(k) for k in key.keys]))
            if arr.shape != tuple(leaf.shape):  # a rule's own mistake, not the checkpoint's
                raise AssertionError(f"{key.name or key.keys[0]}: built {arr.shape}, expected {tuple(leaf.shape)}")
            arr = arr.astype(dtype or arr.dtype, copy=False)
            out[path] = place(path, arr) if place is not None else jax.numpy.asarray(arr)
            continue
        _, transpose = param_path_to_key(path)
        if key not in source.key_to_file:
            missing.append(key)
            continue
        stored_shape = source.shape(key)
        want = tuple(leaf.shape)
        if (stored_shape[::-1] if transpose else stored_shape) != want:
            expected = want[::-1] if transpose else want
            raise CheckpointError(f"{source.file_of(key)}: tensor {source.describe(key)} has shape "
                                  f"{list(stored_shape)}, expected {list(expected)}")
        stored_dtype = source.dtype_name(key)
        if stored_dtype not in FLOAT_DTYPES:  # casting integers or booleans would make a silently wrong model
            raise CheckpointError(f"{source.file_of(key)}: tensor {key!r} is stored as {stored_dtype}; weights must "
                                  f"be floating point ({', '.join(FLOAT_DTYPES)}){_quantized_hint(stored_dtype)}")
        arr = source.get(key)
        if transpose:
            arr = np.ascontiguousarray(arr.T)
        arr = arr.astype(dtype or arr.dtype, copy=False)
        out[path] = place(path, arr) if place is not None else jax.numpy.asarray(arr)
    if missing:
        missing = list(dict.fromkeys(missing))  # a fused tensor feeds several params: name it once
        shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{source.path}: missing {len(missing)} tensor(s): {shown}")
    return unflatten(out)


def params_to_tensors(
    params: Mapping[str, Any], key_of: Callable[[tuple[str, ...]], str], dtype: Any = None
) -> dict[str, np.ndarray]:
    """The inverse of :func:`load_params`: ``{stored key: [out, in] numpy array}``."""
    tensors = {}
    for path, leaf in flatten(params).items():
        _, transpose = param_path_to_key(path)
        arr = np.asarray(leaf)
        if transpose:
            arr = arr.T
        if dtype is not None:
            arr = arr.astype(dtype)
        tensors[key_of(path)] = np.ascontiguousarray(arr)
    return tensors


def save_tensors(
    tensors: Mapping[str, np.ndarray], out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None, progress: bool = False,
) -> list[Path]:
    """Write ``model.safetensors`` (or shards plus an index when larger than ``max_shard_bytes``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key in sorted(tensors):
        arr = tensors[key]
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = arr
        size += arr.nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        path = out_dir / SINGLE_FILE
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(tqdm(shards, desc="writing shards", disable=not progress)):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata=meta)
        weight_map.update({k: name for k in shard})
        paths.append(out_dir / name)
    total = sum(a.nbytes for a in tensors.values())
    (out_dir / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return paths

