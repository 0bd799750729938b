"""A process's settings: one frozen dataclass whose fields define its flags and its config file.

A field made by `flag(...)` is a flag, `--field-name`; a field whose type is itself such a
dataclass (a section) contributes its own fields, flattened, so `tandem serve` is made of the
settings of the processes it starts. A `tuple[str, ...]` field is a repeatable flag (its
environment variable a comma-separated list, its config file key a list). Values come from, in
order of precedence: the command line, the `--config FILE` (YAML or JSON, keys as the flags'
names with - or _, nested sections or flat), the environment variable a field names, and the
field's default. The environment is read here, once, from what `parse` is given; nothing below a
process's `__main__` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml

T = TypeVar("T")


def flag(
    default: T, help: str, *, env: str | None = None, choices: Sequence[str] | None = None
) -> T:
    """A settings field: `max_num_seqs: int = flag(256, "sequences per step")`."""
    metadata = {"help": help, "env": env, "choices": choices}
    return cast(T, dataclasses.field(default=default, metadata=metadata))


def _is_section(kind: Any) -> bool:
    return dataclasses.is_dataclass(kind) and isinstance(kind, type)


def _scalar(kind: Any) -> type:
    """int for `int | None`, and so on: the type a flag's text is converted to (tuple for a
    repeatable flag)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is tuple:
        return tuple
    return cast(type, kind)


class _Repeat(argparse.Action):
    """A repeatable flag whose first use on the command line replaces the default (a config
    file's or the environment's list) instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, f"_{self.dest}_given", False)
        items = list(getattr(namespace, self.dest) or ()) if given else []
        setattr(namespace, self.dest, (*items, values))
        setattr(namespace, f"_{self.dest}_given", True)


def flags_of(cls: type) -> dict[str, tuple[dataclasses.Field[Any], type]]:
    """Every flag of `cls`, sections flattened: name -> (its field, its scalar type)."""
    out: dict[str, tuple[dataclasses.Field[Any], type]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if _is_section(kind):
            for name, item in flags_of(kind).items():
                if name in out:
                    raise TypeError(f"{cls.__name__}: two settings are called {name}")
                out[name] = item
        elif "help" in f.metadata:
            out[f.name] = (f, _scalar(kind))
    return out


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, env: Mapping[str, str]
) -> None:
    """`cls`'s flags on `parser`; each section's in a group of its own name in --help."""
    flags_of(cls)  # refuses two settings of one name
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if _is_section(kind):
            group = parser
            if isinstance(parser, argparse.ArgumentParser):
                group = parser.add_argument_group(f.name)
            add_flags(group, kind, env)
        elif "help" in f.metadata:
            _add_flag(parser, f, _scalar(kind), env)


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    f: dataclasses.Field[Any],
    kind: type,
    env: Mapping[str, str],
) -> None:
    meta = f.metadata
    default = _default(f, kind, env)
    flag = "--" + f.name.replace("_", "-")
    help_text = meta["help"] + (f" (env {meta['env']})" if meta["env"] else "")
    options: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif kind is tuple:
        options.update(action=_Repeat, help=help_text + " (repeatable)")
    else:
        shown = "" if default in (None, "") else f" [default: {default}]"
        options.update(type=kind, choices=meta["choices"], help=help_text + shown)
    parser.add_argument(flag, **options)


def _default(f: dataclasses.Field[Any], kind: type, env: Mapping[str, str]) -> Any:
    variable, choices = f.metadata["env"], f.metadata["choices"]
    if variable and env.get(variable):
        raw = env[variable]
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        if choices and raw not in choices:
            raise ValueError(f"{variable}={raw!r}: {f.name} must be one of {', '.join(choices)}")
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a valid {f.name}") from None
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of `cls` from flat values (by flag name); sections are built in turn."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if _is_section(kind):
            kwargs[f.name] = build(kind, values)
        elif f.name in values and values[f.name] is not None:
            value = values[f.name]
            if _scalar(kind) is tuple:
                value = (value,) if isinstance(value, str) else tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def read_file(path: Path, cls: type) -> dict[str, Any]:
    """The values of a YAML or JSON config file, flattened and checked against `cls`'s flags."""
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read the config file {path}: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    flat = dict(_flatten(data))
    if unknown := sorted(set(flat) - set(flags_of(cls))):
        raise ValueError(f"{path}: unknown settings {', '.join(unknown)}")
    return flat


def _flatten(mapping: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flatten(value)
        else:
            yield str(key).replace("-", "_"), value


def parse(
    cls: type[T], argv: Sequence[str] | None, env: Mapping[str, str], *, prog: str, description: str
) -> T:
    """Settings from the command line, a --config file and the environment; ValueError names
    a bad value."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    help_text = "a YAML or JSON file of settings (flags on the command line win)"
    parser.add_argument("--config", type=Path, help=help_text)
    add_flags(parser, cls, env)
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        parser.set_defaults(**read_file(known.config, cls))
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if not k.startswith("_")}
    args.pop("config")
    return build(cls, args)


def values_of(config: Any) -> dict[str, Any]:
    """The flag values of a settings dataclass, sections flattened: a `--config` file's content
    (what the launcher hands each process it starts)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(values_of(value))
        elif "help" in f.metadata:
            out[f.name] = value
    return out


def write_file(config: Any, path: Path) -> Path:
    path.write_text(json.dumps(values_of(config), indent=1, default=str) + "\n")
    return path
