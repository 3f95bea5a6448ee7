"""``python -m infer convert``: official/Hugging Face checkpoint directories <-> Orbax checkpoints.

The direction comes from the input:

* an Orbax directory written by this project (``meta.json`` + ``params/``) is exported: a draft to the
  official DFlash layout (servable by the reference code, SGLang and vLLM), a target to a Hugging Face
  directory (loadable by transformers);
* an official draft directory (``config.json`` with ``architectures: [DFlashDraftModel]``, a
  ``dflash_config`` or a ``block_size`` field; or Meta's ``MuseGlimmerAssistantModel`` drafter) or a Hugging
  Face target directory is converted to Orbax;
* with ``--layout``, a draft is written in the official DFlash layout or in Meta's drafter layout (exactly, or
  refused with the reason), from an Orbax checkpoint or straight from a draft directory of the other layout.

Tokenizer and generation files found next to the weights travel along (inside the Orbax directory they sit in
``hf_extra/``), so a round trip keeps the tokenizer. The output is written to a temporary sibling directory
and moved into place only when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.checkpoints.loading import EXTRA_DIR, EXTRA_FILES, restore_orbax
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.errors import UserError
from dflash_jax.fileio import ensure_writable_dir, new_directory, recover_directory, replace_directory
from dflash_jax.models.config import TargetConfig, read_json_object
from dflash_jax.models.draft_config import is_muse_assistant_config
from infer.cli import Parser, run_cli

PROG = "python -m infer convert"
DTYPE_CHOICES = ("keep", "float32", "bfloat16")
KIND_CHOICES = ("auto", "target", "draft")
DRAFT_ARCHITECTURE = "DFlashDraftModel"
LAYOUT_CHOICES = ("keep", "dflash", "muse_glimmer_assistant")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description=textwrap.fill(
            "Convert a checkpoint between the official / Hugging Face layout (config.json + safetensors) and "
            "an Orbax checkpoint of this project. The direction is detected from --from: an Orbax directory "
            "(meta.json + params/) is exported (a draft to the official DFlash layout, a target to a Hugging "
            "Face directory); an official draft or Hugging Face target directory is converted to Orbax. "
            "Tokenizer files travel along in both directions.", width=100
        ),
        epilog=(
            "examples:\n"
            f"  {prog} --from ckpt/Qwen3-8B-DFlash-b16 --to orbax/qwen3-8b-draft\n"
            f"  {prog} --from orbax/my-draft --to export/my-draft --dtype bfloat16\n"
            f"  {prog} --from hf/Qwen3-8B --to orbax/qwen3-8b --kind target\n"
            f"  {prog} --from z-lab/Qwen3-8B-DFlash-b16 --to orbax/qwen3-8b-draft   (a Hub id)\n"
            f"  {prog} --from ckpt/Muse-Glimmer-30B-assistant --to export/muse-dflash --layout dflash "
            "--target hf/Muse-Glimmer-30B\n"
            "Exit codes: 0 success, 2 bad arguments or unusable checkpoint (one 'error: ...' line on stderr)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--from", dest="src", required=True, metavar="PATH",
        help="input directory: an Orbax checkpoint written by this project, an official DFlash draft "
             "directory, or a Hugging Face target directory (config.json + model.safetensors or a sharded "
             "model.safetensors.index.json); or a Hugging Face Hub id such as z-lab/Qwen3-8B-DFlash-b16 "
             "(fetched into the Hugging Face cache, or read from it with HF_HUB_OFFLINE=1; a local path of "
             "the same name wins). Pickle weights (.bin/.pt) are refused.",
    )
    parser.add_argument(
        "--revision", metavar="REV",
        help="with a Hub id as --from: its branch, tag or commit (default: main).",
    )
    parser.add_argument(
        "--to", dest="dst", required=True, metavar="PATH",
        help="output directory; created if missing. Must be absent or empty unless --force is given.",
    )
    parser.add_argument(
        "--kind", choices=KIND_CHOICES, default="auto",
        help="what the checkpoint holds. 'auto' (default) reads meta.json of an Orbax input, or the "
             "config.json of an official/HF input (a draft has architectures [DFlashDraftModel], a "
             "dflash_config or a block_size field; anything else is a target). 'draft'/'target' force it "
             "(for an Orbax input it must agree with meta.json).",
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="keep",
        help="dtype of the written weights: 'keep' (default) keeps the stored dtypes bit for bit; "
             "'float32' or 'bfloat16' casts every tensor.",
    )
    parser.add_argument(
        "--layout", choices=LAYOUT_CHOICES, default="keep",
        help="drafts only: the layout of a written draft directory. 'keep' (default) writes a draft in the "
             "layout it was read from. 'dflash' is the official DFlash layout (fc / hidden_norm, nested "
             "dflash_config); 'muse_glimmer_assistant' is Meta's MuseGlimmerAssistantModel (encoder.fc / "
             "encoder.output_norm_enc, top-level fields, a window that includes its edge). Converting is exact "
             "or refused with the reason (a DFlash2 draft, causal layers, an output multiplier or soft-cap, ... "
             "have no Meta form). With an official or Meta draft directory as --from, a layout other than 'keep' "
             "writes a draft directory in that layout instead of an Orbax checkpoint.",
    )
    parser.add_argument(
        "--target", metavar="DIR",
        help="with --layout dflash and one of Meta's drafters: the target checkpoint directory (only its "
             "config.json is read) whose layer count and vocabulary size the DFlash layout states and Meta's "
             "config does not.",
    )
    parser.add_argument(
        "--force", action="store_true",
        help="replace a non-empty --to directory (its old contents are deleted once the new checkpoint is "
             "complete). Never allowed when --to is or contains --from.",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false",
        help="no progress bars or status lines (by default they are printed to stderr).",
    )
    return parser


# ----------------------------------------------------------------------------------------------- helpers


def _dtype(name: str) -> Any:
    """``keep`` -> None; otherwise the JAX dtype."""
    if name == "keep":
        return None
    from dflash_jax.precision import resolve_dtype

    return resolve_dtype(name)


def _say(args: argparse.Namespace, message: str) -> None:
    if args.progress:
        print(message, file=sys.stderr, flush=True)


def is_draft_config(cfg: dict) -> bool:
    """An official DFlash draft config (either field layout), as opposed to a target's config.json."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    return (DRAFT_ARCHITECTURE in archs or "dflash_config" in cfg or "block_size" in cfg
            or is_muse_assistant_config(cfg))


def detect(src: Path, kind: str) -> tuple[str, str]:
    """``(format, kind)`` of the input: format ``orbax`` or ``hf``, kind ``draft`` or ``target``."""
    if not src.exists():
        raise UserError(f"--from {src}: no such file or directory")
    if not src.is_dir():
        raise CheckpointError(f"--from {src}: expected a checkpoint directory, got a file")
    if orbax_io.is_orbax_dir(src):
        meta = orbax_io.read_meta(src)
        stored = meta["kind"]
        if stored not in ("draft", "target"):
            raise CheckpointError(f"{src / orbax_io.META_FILE}: kind {stored!r} is neither 'draft' nor 'target'")
        if not isinstance(meta["config"], dict):
            raise CheckpointError(f"{src / orbax_io.META_FILE}: 'config' must be a JSON object")
        if kind != "auto" and kind != stored:
            raise CheckpointError(
                f"--kind {kind} but {src} holds a {stored} checkpoint (meta.json kind {stored!r})"
            )
        return "orbax", stored
    config = src / "config.json"
    if not config.is_file():
        raise CheckpointError(
            f"--from {src}: neither an Orbax checkpoint of this project (meta.json + params/) nor an "
            "official/Hugging Face directory (no config.json)"
        )
    if kind == "auto":
        kind = "draft" if is_draft_config(read_json_object(config)) else "target"
    return "hf", kind


def check_output(src: Path, dst: Path, force: bool) -> None:
    src_r, dst_r, cwd = src.resolve(), dst.resolve(), Path.cwd().resolve()
    if dst_r == src_r or dst_r in src_r.parents:
        raise UserError(f"--to {dst}: is (or contains) the input directory --from {src}; choose another path")
    if src_r in dst_r.parents:
        raise UserError(f"--to {dst}: lies inside the input directory --from {src}; choose another path")
    if dst_r == cwd or dst_r in cwd.parents:
        raise UserError(f"--to {dst}: is the current directory or one of its parents; choose a new folder name")
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise UserError(f"--to {dst}: exists and is not a directory")
        if any(dst.iterdir()) and not force:
            raise UserError(f"--to {dst}: directory is not empty (pass --force to replace its contents)")


def copy_extras(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer/generation files and modeling code that exist in ``src_dir``; returns their names."""
    copied = []
    # *.py: the modeling code that trust_remote_code checkpoints (the official drafts) ship with their weights.
    names = list(EXTRA_FILES) + sorted(p.name for p in src_dir.glob("*.py")) if src_dir.is_dir() else []
    for name in names:
        f = src_dir / name
        if f.is_file():
            dst_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst_dir / name)
            copied.append(name)
    return copied


def _count_and_dtypes(params: Any) -> tuple[int, str]:
    import jax

    leaves = jax.tree.leaves(params)
    dtypes = sorted({str(leaf.dtype) for leaf in leaves})
    return len(leaves), "/".join(dtypes)


# ---------------------------------------------------------------------------------------- conversions


def to_orbax(src: Path, out: Path, kind: str, dtype: Any, args: argparse.Namespace, shown: Path) -> str:
    if kind == "draft":
        from dflash_jax.checkpoints.official_draft import load_draft

        config, params = load_draft(src, dtype=dtype, progress=args.progress)
        # Keep the fields we do not model (auto_map, transformers_version, ...) for the way back.
        original = read_json_object(src / "config.json")
        config_dict = {**original, **config.to_official_dict()}
    else:
        from dflash_jax.checkpoints.hf_target import load_target

        config, params = load_target(src, dtype=dtype, progress=args.progress)
        config_dict = config.to_hf_dict()
    _say(args, f"writing Orbax checkpoint ({kind}) ...")
    orbax_io.save_params(out, params, kind, config_dict)
    extras = copy_extras(src, out / EXTRA_DIR)
    n, dtypes = _count_and_dtypes(params)
    extra = f", kept {', '.join(extras)}" if extras else ""
    return f"converted {kind} {src} -> Orbax {shown} ({n} tensors, {dtypes}{extra})"


def relayout(config: Any, args: argparse.Namespace) -> Any:
    """The draft config in ``--layout`` (exact, or a ConfigError naming why not)."""
    if args.layout == "keep":
        return config
    target = None
    if args.target is not None:
        target = TargetConfig.from_json(Path(args.target) / "config.json")
    return config.with_layout(args.layout, target)


def draft_to_draft(src: Path, out: Path, dtype: Any, args: argparse.Namespace, shown: Path) -> str:
    """An official or Meta draft directory rewritten in ``--layout`` (the same tensors under that layout's
    names)."""
    from dflash_jax.checkpoints.official_draft import load_draft, save_draft

    config, params = load_draft(src, dtype=dtype, progress=args.progress)
    config = relayout(config, args)
    save_draft(config, params, out, extra_config=read_json_object(src / "config.json"))
    extras = copy_extras(src, out)
    n, dtypes = _count_and_dtypes(params)
    extra = f", kept {', '.join(extras)}" if extras else ""
    return f"converted draft {src} -> {config.layout} layout {shown} ({n} tensors, {dtypes}{extra})"


def from_orbax(src: Path, out: Path, kind: str, dtype: Any, args: argparse.Namespace, shown: Path) -> str:
    _say(args, f"reading Orbax checkpoint {src} ...")
    config, params = restore_orbax(src, kind, dtype)
    if kind == "draft":
        config = relayout(config, args)
    _say(args, f"writing {'official draft' if kind == 'draft' else 'Hugging Face target'} directory ...")
    if kind == "draft":
        from dflash_jax.checkpoints.official_draft import save_draft

        save_draft(config, params, out, extra_config=orbax_io.read_meta(src)["config"])
    else:
        from dflash_jax.checkpoints.hf_target import save_target

        save_target(config, params, out)
    extras = copy_extras(src / EXTRA_DIR, out)
    n, dtypes = _count_and_dtypes(params)
    extra = f", kept {', '.join(extras)}" if extras else ""
    layout = "official draft" if kind == "draft" else "Hugging Face"
    return f"converted Orbax {kind} {src} -> {layout} {shown} ({n} tensors, {dtypes}{extra})"


def convert(args: argparse.Namespace) -> str:
    """Write the converted checkpoint into a temporary folder next to ``--to`` and swap it in only when
    complete (``dflash_jax.fileio``): an interrupt leaves the old output or the new one, never neither."""
    src, dst = resolve_checkpoint(args.src, args.revision, "--from"), Path(args.dst)
    fmt, kind = detect(src, args.kind)
    if args.layout != "keep" and kind != "draft":
        raise UserError(f"--layout {args.layout}: only a draft has a layout; {src} holds a {kind}")
    if args.target is not None and args.layout != "dflash":
        raise UserError("--target is only read with --layout dflash (Meta's drafter to the DFlash layout)")
    recover_directory(dst)  # what a killed earlier run left next to --to
    check_output(src, dst, args.force)
    dtype = _dtype(args.dtype)
    ensure_writable_dir(dst.absolute().parent, "--to")
    tmp = new_directory(dst)
    try:
        out = tmp / "out"  # the writers create their own directory
        if fmt == "orbax":
            summary = from_orbax(src, out, kind, dtype, args, dst)
        elif kind == "draft" and args.layout != "keep":
            summary = draft_to_draft(src, out, dtype, args, dst)
        else:
            summary = to_orbax(src, out, kind, dtype, args, dst)
        os.replace(out, tmp / "done")
        replace_directory(tmp / "done", dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    def action(args: argparse.Namespace) -> int:
        print(convert(args))
        return 0

    return run_cli(build_parser(), action, argv)


if __name__ == "__main__":
    sys.exit(main())
