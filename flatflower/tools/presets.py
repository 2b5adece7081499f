"""Presets: TOML files that pin one paper's experimental setting.

    [preset]
    description = "FedTOGA, CIFAR-10, LeNet, Dirichlet u=0.1, 100 clients at 10%"
    source = "FedTOGA (Li et al.), Table 1 ...: FedTOGA 82.05±0.11"
    clients = 100                    # optional; the CLI's --clients default
    engine = "inprocess"             # optional; simulate's --engine default (else ray)

    [config]                         # run-config keys, as in [tool.flwr.app.config]
    algorithm = "fedtoga"
    ...

    [algorithms.fedsam]              # optional: applied over [config] when the run's
    "sam.rho" = 0.01                 # algorithm is fedsam (a study setting for every method)

``flatflower local|simulate --preset NAME_OR_FILE`` accepts a file path or the name of a file
in ``tools/presets/`` of this checkout (``--preset fedtoga-cifar10-lenet-dir0.1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatflower.common.config import ConfigError, RunConfig, did_you_mean, flat_keys, user_path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRESET_DIR = Path(__file__).resolve().parent / "presets"  # package data
PRESET_KEYS = ("description", "source", "clients", "engine")


class PresetError(ValueError):
    """A preset that cannot be found, parsed or validated."""


@dataclass(frozen=True)
class Preset:
    """One preset: what it reproduces, its client count and its run-config values."""

    description: str
    source: str = ""
    clients: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    algorithms: dict[str, dict[str, Any]] = field(default_factory=dict)  # [algorithms.<name>]
    engine: str | None = None  # simulate's engine when --engine is not given

    def values(self, algorithm: str | None = None) -> dict[str, Any]:
        """The run-config values for ``algorithm`` (default: [config]'s): [config], then that
        algorithm's own table over it."""
        algorithm = algorithm or self.config.get("algorithm") or RunConfig.algorithm
        return {**self.config, **self.algorithms.get(algorithm, {})}

    @property
    def name(self) -> str:
        return self.path.stem if self.path else ""


def available(directory: Path = PRESET_DIR) -> list[str]:
    """Names of the presets in ``directory`` (file stems, sorted)."""
    return sorted(p.stem for p in directory.glob("*.toml")) if directory.is_dir() else []


def find_preset(name_or_path: str | Path, directory: Path = PRESET_DIR) -> Path:
    """The file of a preset: an existing path, else ``directory/<name>.toml``."""
    try:
        path = user_path(str(name_or_path), "--preset")
    except ConfigError as err:
        raise PresetError(str(err)) from None
    if path.is_file():
        return path
    text = str(name_or_path)
    path_like = "/" in text or "\\" in text or text.endswith(".toml")
    candidate = directory / f"{text}.toml"
    if not path_like and candidate.is_file():  # a preset's name wins over a folder of that name here
        return candidate
    if path.is_dir():
        raise PresetError(f"preset {text} is a directory: give a preset's TOML file or name")
    if path_like:
        raise PresetError(f"preset file {text} not found")
    names = ", ".join(available(directory)) or "none"
    raise PresetError(f"unknown preset {text!r}{did_you_mean(text, available(directory))}; "
                      f"available presets: {names}")


def load_preset(name_or_path: str | Path, directory: Path = PRESET_DIR) -> Preset:
    """Read and validate a preset (a file path or a name in ``directory``)."""
    path = find_preset(name_or_path, directory)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"{path}: invalid TOML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PresetError(f"{path}: cannot read preset: {err}") from None
    except (ValueError, RecursionError) as err:  # an int of over 4300 digits; nesting too deep
        raise PresetError(f"{path}: invalid TOML: {str(err)[:200]}") from None

    unknown = sorted(set(data) - {"preset", "config", "algorithms"})
    if unknown:
        raise PresetError(f"{path}: unknown table(s) {', '.join(unknown)}; "
                          "a preset has [preset], [config] and optionally [algorithms.<name>]")
    for table in ("preset", "config"):
        if table not in data:
            raise PresetError(f"{path}: missing [{table}] table")
        if not isinstance(data[table], dict):
            raise PresetError(f"{path}: {table} must be a table ([{table}])")
    meta = data["preset"]
    try:
        config = flat_keys(data["config"])
    except RecursionError:
        raise PresetError(f"{path}: [config] is nested too deeply") from None

    unknown = sorted(set(meta) - set(PRESET_KEYS))
    if unknown:
        raise PresetError(f"{path}: unknown key(s) in [preset]: {', '.join(unknown)}; "
                          f"valid keys: {', '.join(PRESET_KEYS)}")
    for key in ("description", "source"):
        if not isinstance(meta.get(key, ""), str):
            raise PresetError(f"{path}: [preset] {key} must be a string")
    if not meta.get("description", "").strip():
        raise PresetError(f"{path}: [preset] needs a description")
    clients = meta.get("clients")
    if clients is not None and (type(clients) is not int or clients < 1):  # bool is not int here
        raise PresetError(f"{path}: [preset] clients must be a positive integer, got {clients!r}")

    engine = meta.get("engine")
    if engine is not None and engine not in ("ray", "inprocess", "vectorized"):
        raise PresetError(f"{path}: [preset] engine must be ray, inprocess or vectorized, got {engine!r}")
    algorithms = _algorithm_tables(path, data.get("algorithms", {}))
    base = {"num-partitions": clients} if clients else {}
    try:  # with its clients: a dataset generated per client needs their number
        RunConfig.from_mapping({**base, **config})
    except ConfigError as err:
        raise PresetError(f"{path}: [config]: {err}") from None
    for name, values in algorithms.items():
        try:
            RunConfig.from_mapping({**base, **config, **values, "algorithm": name})
        except ConfigError as err:
            raise PresetError(f"{path}: [algorithms.{name}]: {err}") from None
    return Preset(meta["description"], meta.get("source", ""), clients, dict(config), path, algorithms,
                  engine)


def _algorithm_tables(path: Path, tables: Any) -> dict[str, dict[str, Any]]:
    """[algorithms.<name>] tables: known algorithm names, each a table of run-config keys
    (flattened: a nested ``sam.rho`` or a quoted ``"sam.rho"``); ``algorithm`` itself is not
    one of them."""
    from flatflower.common.references import is_reference
    from flatflower.strategies.registry import ALGORITHMS, get

    if not isinstance(tables, dict):
        raise PresetError(f"{path}: algorithms must be tables ([algorithms.<name>])")
    out = {}
    for name, table in tables.items():
        if is_reference(name):
            try:
                get(name)  # a user's algorithm, loaded now (its keys become known)
            except ValueError as err:
                raise PresetError(f"{path}: [algorithms.\"{name}\"]: {err}") from None
        if name not in ALGORITHMS:
            raise PresetError(f"{path}: [algorithms.{name}]: unknown algorithm "
                              f"{name!r}{did_you_mean(name, ALGORITHMS)}")
        if not isinstance(table, dict):
            raise PresetError(f"{path}: algorithms.{name} must be a table ([algorithms.{name}])")
        try:
            values = flat_keys(table)
        except RecursionError:
            raise PresetError(f"{path}: [algorithms.{name}] is nested too deeply") from None
        if "algorithm" in values:
            raise PresetError(f"{path}: [algorithms.{name}] cannot set algorithm")
        out[name] = values
    return out


def markdown_table(directory: Path = PRESET_DIR) -> str:
    """The table of docs/presets.md: every preset with its clients, what it is and what it
    reproduces, from the files themselves (a test keeps the page equal to it, so adding a
    preset cannot leave the docs behind)."""

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = ["| preset | clients | what it is | reproduces (`source`) |", "|---|---|---|---|"]
    for name in available(directory):
        preset = load_preset(name, directory)
        rows.append(f"| `{name}` | {preset.clients or '-'} | {cell(preset.description)} | {cell(preset.source or '-')} |")
    return "\n".join(rows)
