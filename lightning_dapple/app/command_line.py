"""What ``dapple-train`` checks of its command line beyond Hydra's schema, and how Hydra's
own errors read.

* ``cluster=/path/to/file.yaml``: a config group option is a name, not a path, in Hydra;
  ``cluster_file_overrides`` registers each YAML file named by path (one, or a comma list
  for ``-m``) as a ``cluster`` option under its file name before Hydra composes, so the
  file is checked against the schema like a preset. Whole folders of recipes and clusters
  of one's own come in with Hydra's ``--config-dir DIR`` (``DIR/recipe/NAME.yaml``,
  ``DIR/cluster/NAME.yaml``).
* ``+group.key=value`` adds a key the schema does not have (Hydra's ``+`` appends even to
  a structured config): ``check_known_keys`` refuses a key that no part of the app would
  read, naming the known ones, as ``model``/``data`` keys are checked against their
  constructors.
* ``hydra_error_line``: Hydra's multi-line composition and override errors as one line
  with a ``Fix:`` part, like every other bad-configuration line of the app.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from hydra.core.config_store import ConfigStore
from lightning.pytorch import Trainer
from omegaconf import DictConfig, OmegaConf

from lightning_dapple.app.config import AppConfig, ClusterConfig, LoggerConfig, OutputsConfig, StrategyConfig, TrainerConfig, group_options
from lightning_dapple.errors import DappleConfigError, require

__all__ = ["FILE_GROUPS", "check_known_keys", "cluster_file_overrides", "hydra_error_line"]

#: config groups whose option may be given as the path of a YAML file
FILE_GROUPS = ("cluster",)
#: the app's own groups (schema dataclasses); ``model`` and ``data`` are checked against their constructors
SCHEMAS: dict[str, type] = {"trainer": TrainerConfig, "strategy": StrategyConfig, "cluster": ClusterConfig, "logger": LoggerConfig, "outputs": OutputsConfig}
#: Trainer arguments the app sets itself
_APP_SETS = {"strategy", "logger", "callbacks", "default_root_dir"}


def _fields(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def _looks_like_path(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or "/" in value


def cluster_file_overrides(argv: list[str]) -> list[str]:
    """``argv`` with each ``cluster=<path of a YAML file>`` replaced by ``cluster=<its name>``,
    the file registered as that option (comma lists of ``-m`` sweeps too)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key.lstrip("+~") not in FILE_GROUPS or not any(_looks_like_path(part) for part in value.split(",")):
            out.append(arg)
            continue
        group = key.lstrip("+~")
        names = [_register_file(group, part) if _looks_like_path(part) else part for part in value.split(",")]
        out.append(f"{key}={','.join(names)}")
    return out


def _register_file(group: str, value: str) -> str:
    path = Path(value).expanduser().resolve()
    require(
        path.is_file(),
        group,
        f"{value!r} is not a file",
        f"give the path of a {group} YAML (keys as in lightning_dapple/conf/{group}/local-cpu.yaml) or one of {', '.join(group_options(group))}",
    )
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # YAML syntax: the parser's own words, on one line
        raise DappleConfigError(group, f"{value!r} is not valid YAML ({str(exc).splitlines()[0]})", "fix the file") from None
    require(isinstance(node, DictConfig), group, f"{value!r} holds no mapping", f"write the {group}'s keys, one per line (key: value)")
    name = path.stem if path.stem not in group_options(group) else f"{path.stem}_file"  # a packaged option of that name would win
    ConfigStore.instance().store(group=group, name=name, node=node, provider="command line")
    return name


def _trainer_keys() -> set[str]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {name for name, p in inspect.signature(Trainer.__init__).parameters.items() if p.kind in kinds and name != "self"} - _APP_SETS


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key (added with ``+``) that the app's schema does not have; a ``trainer`` key
    may also be any other ``lightning.pytorch.Trainer`` argument, which the app hands on."""
    top = _fields(AppConfig)
    unknown = sorted(set(cfg.keys()) - top)
    require(not unknown, unknown[0] if unknown else "", "is not a key of dapple-train's config", f"use only {sorted(top)}")
    for group, schema in SCHEMAS.items():
        known = _fields(schema)
        extra = set(cfg[group].keys()) - known
        if group == "trainer":
            extra -= _trainer_keys()
        if extra:
            first = sorted(extra)[0]
            also = " or another lightning.pytorch.Trainer argument" if group == "trainer" else ""
            raise DappleConfigError(f"{group}.{first}", f"is not an option of {group}", f"use one of {sorted(known)}{also}")


# --------------------------------------------------------------------------- Hydra's errors


def hydra_error_line(exc: BaseException) -> str:
    """Hydra's (multi-line) message, its cause, and what to do, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:  # "In 'cluster/mine': ValidationError raised while composing config:" + what
        first = f"{first} {lines[1]}"
    options = _available_options(lines)
    text = first + (f" (available: {', '.join(options)})" if options else "")
    cause = exc.__cause__
    if cause is not None:
        cause_lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        if cause_lines and cause_lines[0] not in text:
            text = text.rstrip(".") + f": {cause_lines[0]}"
    return f"{text.rstrip('.')}. Fix: {_fix(exc, first, options)}"


def _available_options(lines: list[str]) -> list[str]:
    start = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
    options: list[str] = []
    for line in lines[start + 1 :] if start is not None else ():
        if line.startswith("Config search path") or " " in line:
            break
        options.append(line)
    return options


def _fix(exc: BaseException, first: str, options: list[str]) -> str:
    """What to do about one of Hydra's errors, from its kind and the key it names."""
    cause = exc.__cause__
    full_key = str(getattr(cause, "full_key", "") or "")
    kind = type(cause).__name__ if cause is not None else type(exc).__name__
    raised = re.search(r"(\w+) raised while composing", first)  # an error inside a config file: kind and key in the text
    if cause is None and raised:
        kind, cause = raised[1], first
        found = re.search(r"full_key: (\S+)", str(exc))
        full_key = found[1] if found else ""
    if first.startswith("In ") and "Could not find" in first:
        group = first.split("'")[3].split("/")[0] if first.count("'") >= 4 else "GROUP"
        path_too = f", a file by path ({group}=/path/to/file.yaml)" if group in FILE_GROUPS else ""
        return f"pick one of the available ones{path_too}, or add your own as DIR/{group}/NAME.yaml and run dapple-train --config-dir DIR {group}=NAME ..."
    if kind in ("ConfigAttributeError", "ConfigKeyError") and full_key:
        group, _, _ = full_key.rpartition(".")
        known = _fields(SCHEMAS[group]) if group in SCHEMAS else _fields(AppConfig) if not group else None
        return f"use one of {sorted(known)}" if known is not None else f"check the spelling of {full_key} (dapple-train --cfg job shows every key)"
    if kind == "ValidationError" and "expected one of" in str(cause):
        return f"give {full_key} one of the values listed"
    if kind == "ValidationError" and full_key:
        return f"give {full_key} a value of the type its schema has (lightning_dapple/app/config.py; dapple-train --cfg job shows the current one)"
    if kind == "ConfigTypeError" and "deletion" in str(cause):
        return f"set {full_key} to another value instead of deleting it"
    if type(exc).__name__ == "OverrideParseException":
        return "write each override as key=value and quote a value with brackets, commas or spaces (key='a,b'); grammar: https://hydra.cc/docs/advanced/override_grammar/basic/"
    if "already at" in first:
        return "drop the + in front of the key: it is in the config already"
    return "check the override it names (dapple-train --help lists the groups, --cfg job shows the composed config)"
