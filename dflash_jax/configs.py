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
