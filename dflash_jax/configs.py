"""Model pairings: one YAML file per target/draft pair (the repository's ``configs/`` folder).

A pairing file has the top-level keys ``target`` (the target's Hugging Face ``config.json`` as a mapping),
``draft`` (the draft's official ``config.json``), and the informational ``name``, ``hf_target`` and
``hf_draft`` (hub ids). :func:`load_pairing` parses both with the library parsers and checks that the draft
can run on the target; every problem is a :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml

from dflash_jax.models.config import ConfigError, TargetConfig
from dflash_jax.models.draft_config import DraftConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SUFFIXES = (".yaml", ".yml")


@dataclasses.dataclass(frozen=True)
class Pairing:
    name: str
    target: TargetConfig
    draft: DraftConfig
    raw: dict

    @property
    def hf_target(self) -> str | None:
        return self.raw.get("hf_target")

    @property
    def hf_draft(self) -> str | None:
        return self.raw.get("hf_draft")


def available_pairings(config_dir: str | Path = CONFIG_DIR) -> list[str]:
    """Bare names of the pairing files shipped in ``config_dir`` (sorted)."""
    config_dir = Path(config_dir)
    if not config_dir.is_dir():
        return []
    return sorted(p.stem for p in config_dir.iterdir() if p.suffix in SUFFIXES and p.is_file())


def resolve_pairing_path(path_or_name: str | Path, config_dir: str | Path = CONFIG_DIR) -> Path:
    """A path to an existing file, or a bare name (with or without ``.yaml``) of a file in ``config_dir``."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    if path.exists():
        raise ConfigError(f"{path}: not a file (expected a pairing YAML file)")
    config_dir = Path(config_dir)
    if len(path.parts) == 1:
        stem = path.stem if path.suffix in SUFFIXES else path.name
        for suffix in SUFFIXES:
            candidate = config_dir / (stem + suffix)
            if candidate.is_file():
                return candidate
    names = available_pairings(config_dir)
    shown = ", ".join(names) if names else f"none found in {config_dir}"
    raise ConfigError(f"{path_or_name}: no such pairing file or name (available names: {shown})")


def _section(raw: Mapping[str, Any], key: str, source: Path) -> Mapping[str, Any]:
    if key not in raw:
        raise ConfigError(f"{source}: missing top-level key {key!r}")
    value = raw[key]
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: key {key!r} must be a mapping (a config.json dict), got {type(value).__name__}")
    return value


def parse_pairing(raw: Any, source: str | Path = "pairing") -> Pairing:
    """Build a :class:`Pairing` from an already loaded YAML/JSON mapping."""
    source = Path(source)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a mapping with keys 'target' and 'draft', got {type(raw).__name__}")
    target = TargetConfig.from_dict(_section(raw, "target", source), source=f"{source} [target]")
    draft = DraftConfig.from_dict(_section(raw, "draft", source), source=f"{source} [draft]")
    draft.validate_against(target, source=f"{source} [draft]")
    name = raw.get("name", source.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: key 'name' must be a non-empty string, got {name!r}")
    for key in ("hf_target", "hf_draft"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f"{source}: key {key!r} must be a hub id string, got {raw[key]!r}")
    return Pairing(name=name, target=target, draft=draft, raw=dict(raw))


def load_pairing(path_or_name: str | Path, config_dir: str | Path = CONFIG_DIR) -> Pairing:
    """Load a pairing YAML file by path, or by bare name from the repository's ``configs/`` folder."""
    path = resolve_pairing_path(path_or_name, config_dir)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())
        raise ConfigError(f"{path}: not valid YAML ({detail})") from None
    return parse_pairing(raw, source=path)


def write_hf_configs(path_or_name: str | Path, out_dir: str | Path, which: str = "target",
                     config_dir: str | Path = CONFIG_DIR) -> Path:
    """Write a pairing's ``target`` (or ``draft``) mapping as ``out_dir/config.json``, verbatim, and return its
    path: a config-only checkpoint directory for what reads one (``python -m train plan --config RUN.yaml
    --set target.path=out_dir`` plans a run on a target whose weights are not on this machine)."""
    import json

    if which not in ("target", "draft"):
        raise ConfigError(f"which must be 'target' or 'draft', got {which!r}")
    pairing = load_pairing(path_or_name, config_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(pairing.raw[which], indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash_jax.configs NAME [--target-dir DIR] [--draft-dir DIR]``: check a pairing (load and
    validate it, print its shapes) and optionally write its target's / draft's config.json."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_jax.configs", description=main.__doc__)
    parser.add_argument("pairing", nargs="?", help="a pairing name or YAML path (default: list the names)")
    parser.add_argument("--target-dir", metavar="DIR", help="write the target's config.json into DIR")
    parser.add_argument("--draft-dir", metavar="DIR", help="write the draft's config.json into DIR")
    args = parser.parse_args(argv)
    if args.pairing is None:
        print("\n".join(available_pairings()))
        return 0
    try:
        p = load_pairing(args.pairing)
        t, d = p.target, p.draft
        experts = (f", {t.experts.num_experts} experts top-{t.experts.top_k} of width {t.experts.intermediate_size}"
                   if t.experts else "")
        print(f"{p.name}: target {t.model_type}, {t.num_hidden_layers} layers, hidden {t.hidden_size}{experts}, "
              f"vocab {t.vocab_size}; draft {d.num_hidden_layers} layers, block {d.block_size}, features of "
              f"target layers {list(d.target_layer_ids)}, mask token {d.mask_token_id}")
        for which, out in (("target", args.target_dir), ("draft", args.draft_dir)):
            if out:
                print(f"wrote {write_hf_configs(args.pairing, out, which)}")
    except ConfigError as e:
        print(f"error: {e}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
