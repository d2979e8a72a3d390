"""Typed, validated, documented configuration: the generic machinery.

A config is a tree of `ConfigModel`s (pydantic). Each field carries a one-line docstring
under it (CleanRL style); pydantic turns it into the field's description, which
`describe_config` prints. Models are frozen and reject unknown keys, so a typo fails
loudly instead of silently falling back to a default.

A run's config comes from one YAML file plus `a.b.c=value` overrides (`load_config`); the
resolved config is saved next to the run's outputs with `dump_config`, and loading that
file again gives the same config.

Every problem surfaces as one `ConfigError` that lists each offending field by its dotted
path, what is wrong and, where we can tell, the fix:

    actor.ppo_mini_batch_prompts: must divide trainer.prompts_per_step (256); got 100 ...
    actor.lr_rate: unknown field — did you mean 'actor.lr'?

Validators that check several fields raise `ConfigError` themselves, with paths relative to
the model they live on; `validate_config` re-roots them under the model's own path.

Design choices: no environment-variable layer and no config inheritance (one file, then
explicit overrides, is the whole story); components never receive a config object —
builders read the fields they need and pass plain arguments. `fields_from` builds such a
plain settings dataclass from a config by field name, so no builder lists fields by hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pydantic
import pydantic_core
import yaml
from pydantic import ConfigDict

__all__ = [
    "SECRET",
    "ConfigError",
    "ConfigModel",
    "apply_overrides",
    "describe_config",
    "dump_config",
    "fields_from",
    "load_config",
    "redacted_values",
    "secret_field_names",
    "settings_json",
    "validate_config",
]

M = TypeVar("M", bound="ConfigModel")
D = TypeVar("D")


class ConfigModel(pydantic.BaseModel):
    """Base of every config section: frozen, no unknown keys, documented fields.

    Write each field's description as a docstring on the line under it:

        lr: float = Field(1e-3, gt=0)
        \"\"\"Learning rate of AdamW.\"\"\"
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=True
    )
    former_fields: ClassVar[Mapping[str, str]] = {}
    """Names this section had in earlier releases -> where that setting is set now; a
    config still using one fails naming the new place."""


def fields_from(settings: type[D], source: object, **overrides: Any) -> D:
    """A `settings` dataclass whose every field is `source`'s attribute of the same name,
    except those given in `overrides` (values the builder derives: a model's limits, a
    share of a batch). A field `source` lacks is an AttributeError naming both."""
    names = [field.name for field in dataclasses.fields(settings) if field.init]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"{settings.__name__} has no field(s) {unknown}")
    values = {}
    for name in names:
        if name in overrides:
            values[name] = overrides[name]
        elif hasattr(source, name):
            values[name] = getattr(source, name)
        else:
            raise AttributeError(
                f"{settings.__name__}.{name}: {type(source).__name__} has no field {name!r}; "
                "add it there or pass it as an override"
            )
    return settings(**values)


class ConfigError(ValueError):
    """An invalid config: one or more `(dotted.path, problem)` issues.

    `issues` holds them in order; `str(error)` lists them one per line. An empty path means
    the problem is with the config as a whole (for example, the YAML does not parse).
    Validators raise it with paths relative to their own model; `validate_config` prefixes
    the model's position in the tree.
    """

    def __init__(self, issues: str | Sequence[tuple[str, str]], message: str | None = None):
        if isinstance(issues, str):
            issues = [("", issues)] if message is None else [(issues, message)]
        elif message is not None:
            raise TypeError("pass either (path, message) or a sequence of issues")
        self.issues: tuple[tuple[str, str], ...] = tuple((p, m) for p, m in issues)
        if not self.issues:
            raise ValueError("ConfigError needs at least one issue")
        super().__init__(self._render())

    @property
    def paths(self) -> tuple[str, ...]:
        """Dotted paths of the offending fields, in order (may repeat)."""
        return tuple(p for p, _ in self.issues)

    def _render(self) -> str:
        lines = [f"{p}: {m}" if p else m for p, m in self.issues]
        if len(lines) == 1:
            return lines[0]
        return f"{len(lines)} problems in config:\n" + "\n".join(f"  {line}" for line in lines)


# --- YAML -------------------------------------------------------------------------------


def import_object(spec: str, kind: str) -> Any:
    """The object a "package.module:attribute" path names (a user's rule, tool, ...).

    Raises:
        ConfigError: a malformed path, an unimportable module or a missing attribute,
            naming `kind` ("function", "class"); the field path is relative ("" = the
            field holding `spec`), so a config validator can re-root it.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError("", f"{spec!r}: an import path looks like 'package.module:{kind}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError("", f"cannot import module {module_name!r}: {error}") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise ConfigError("", f"module {module_name!r} has no {kind} {attribute!r}")
    return found


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` as a float (YAML 1.2) and rejects duplicate keys."""


# PyYAML follows YAML 1.1, where a float needs a dot ("1e-3" is a string). Swap in the
# YAML 1.2 float pattern on a private copy of the resolver table.
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings `_Loader` would read as something else ('1e-3')."""


_Dumper.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


# --- loading ----------------------------------------------------------------------------


def load_config(
    model_cls: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> M:
    """Read a YAML config file, apply `a.b.c=value` overrides, validate.

    Args:
        model_cls: the root config model, e.g. `RunConfig`.
        path: YAML file whose top level is a mapping; None starts from all defaults.
        overrides: `dotted.key=value` strings applied in order after the file. Each value
            is read as YAML: `1e-3`, `true`, `[1, 2]`, `null` and `"text"` all work.

    Returns:
        The validated, frozen config.

    Raises:
        ConfigError: unreadable file, top level not a mapping, malformed override, or any
            validation problem (all of them, each with its dotted path).
    """
    data: Any = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
        data = _parse_yaml(text, str(path))
        if data is None:  # an empty file means "all defaults"
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of section names to settings; "
                f"got a {type(data).__name__}"
            )
    return validate_config(model_cls, apply_overrides(data, overrides))


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` override set (value read as YAML).

    Missing intermediate keys (and null ones) become mappings; the result is not
    validated, so an unknown key is reported later with a suggestion.
    """
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"override {item!r}: expected 'dotted.key=value'")
        parts = key.split(".")
        if not key or not all(parts):
            raise ConfigError(f"override {item!r}: bad key {key!r}; expected 'dotted.key=value'")
        value = _parse_yaml(raw, f"override {item!r}")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    where,
                    f"is {child!r}, not a mapping, so override {item!r} cannot set a key inside it",
                )
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def validate_config(model_cls: type[M], data: Any) -> M:
    """Validate plain data (e.g. parsed YAML) into `model_cls`, raising only `ConfigError`."""
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise _to_config_error(model_cls, e) from None


def dump_config(model: ConfigModel, redact: bool = False) -> str:
    """The config as YAML text; `load_config` of that text gives an equal config. With
    `redact`, for printing: every non-empty SECRET field shows as REDACTED."""
    data = model.model_dump()
    if redact:
        data = redacted_values(data, secret_field_names(type(model)))
    return yaml.dump(_plain(data), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


SECRET: dict[str, Any] = {"secret": True}
"""`Field(json_schema_extra=SECRET)` marks a field whose value settings_json hides."""
REDACTED = "<redacted>"


def settings_json(model: ConfigModel) -> str:
    """The model as JSON (what a service reports about itself), secrets redacted."""
    import json

    return json.dumps(_redacted(model), sort_keys=True)


def secret_field_names(model_cls: type[pydantic.BaseModel]) -> frozenset[str]:
    """Names of the fields marked SECRET anywhere in `model_cls`'s tree (e.g. "headers"),
    for hiding them in plain data made from such a model (a Serve app's args)."""
    return frozenset(
        path.rsplit(".", 1)[-1]
        for path, field in _walk_fields(model_cls)
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")
    )


def redacted_values(value: Any, secret_names: frozenset[str]) -> Any:
    """Plain data with every non-empty entry named in `secret_names` replaced by
    REDACTED, at any depth."""
    if isinstance(value, Mapping):
        return {
            key: REDACTED if key in secret_names and item else redacted_values(item, secret_names)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redacted_values(item, secret_names) for item in value]
    return value


def _redacted(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            item = getattr(value, name)
            extra = field.json_schema_extra
            secret = isinstance(extra, dict) and extra.get("secret") and item
            out[name] = REDACTED if secret else _redacted(item)
        return out
    if isinstance(value, Mapping):
        return {str(key): _redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(item) for item in value]
    return pydantic_core.to_jsonable_python(value)


def _plain(value: Any) -> Any:
    """Data YAML can write: containers as dict/list, scalars as is (inf stays inf, unlike
    pydantic's JSON mode, which writes null), anything else as pydantic's JSON form."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return pydantic_core.to_jsonable_python(value)


# --- validation errors ------------------------------------------------------------------


def _to_config_error(model_cls: type[pydantic.BaseModel], e: pydantic.ValidationError):
    issues: list[tuple[str, str]] = []
    for err in e.errors():
        loc = tuple(err["loc"])
        where = _dotted(loc)
        inner = (err.get("ctx") or {}).get("error")
        if err["type"] == "value_error" and isinstance(inner, ConfigError):
            # Raised by one of our validators with paths relative to the model at `loc`.
            for path, msg in inner.issues:
                issues.append((".".join(p for p in (where, path) if p), msg))
        elif err["type"] == "extra_forbidden":
            issues.append((where, _unknown_field_message(model_cls, loc)))
        elif err["type"] in ("value_error", "assertion_error"):
            issues.append((where, str(inner) if inner is not None else err["msg"]))
        else:
            msg = err["msg"]
            if err["type"] != "missing":
                msg += f"; got {_short_repr(err['input'])}"
            issues.append((where, msg))
    return ConfigError(issues)


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unknown_field_message(root: type[pydantic.BaseModel], loc: tuple) -> str:
    key, parent = str(loc[-1]), _dotted(loc[:-1])
    model = _model_at(root, loc[:-1])
    former = getattr(model, "former_fields", {})
    if key in former:
        return f"no longer a field; set {former[key]} instead"
    names = list(model.model_fields) if model is not None else []
    msg = "unknown field"
    # A field of that exact name in another section beats a near miss in this one.
    elsewhere = [p for p, _ in _walk_fields(root) if p.rsplit(".", 1)[-1] == key]
    guess = _suggest(key, names)
    if elsewhere or guess is not None:
        meant = elsewhere[0] if elsewhere else ".".join(p for p in (parent, guess) if p)
        return msg + f" — did you mean {meant!r}?"
    if names:
        where = f" of {parent!r}" if parent else ""
        return msg + f"; the fields{where} are: " + ", ".join(names)
    return msg


def _suggest(key: str, names: Sequence[str]) -> str | None:
    """Closest field name to a mistyped `key`, or None when nothing is plausibly meant."""
    ratio = lambda n: difflib.SequenceMatcher(None, key.lower(), n.lower()).ratio()  # noqa: E731
    # Whole words first: 'lr_rate' means 'lr' (not the letter-wise closer 'lora_rank'),
    # 'sft_steps' means 'sft_max_steps'.
    words = set(key.lower().split("_"))
    related = [n for n in names if (w := set(n.lower().split("_"))) <= words or words <= w]
    if related:
        return max(related, key=ratio)
    lowered = {n.lower(): n for n in names}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def _model_at(root: type[pydantic.BaseModel], loc: Sequence[str | int]):
    model: type[pydantic.BaseModel] | None = root
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _submodel(model.model_fields[part].annotation)
    return model


def _submodel(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The model class a field holds (also through `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


# --- description ------------------------------------------------------------------------


def _walk_fields(
    model_cls: type[pydantic.BaseModel], prefix: str = ""
) -> Iterator[tuple[str, pydantic.fields.FieldInfo]]:
    """(dotted path, field) for every field, depth first, sections before their fields."""
    for name, field in model_cls.model_fields.items():
        path = f"{prefix}{name}"
        yield path, field
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from _walk_fields(sub, path + ".")


def describe_config(model_cls: type[pydantic.BaseModel]) -> str:
    """Every dotted field of `model_cls` with its type, default, bounds and docstring.

    Sections are listed as headers followed by their fields, e.g.

        actor.lr: float = 0.0002  (> 0)
            Learning rate of the actor's AdamW optimizer.

    A field whose `json_schema_extra` holds {"choices": {name: line}} also lists each
    choice with its line (the algorithm fields: what each name does and its paper).
    """
    lines: list[str] = []
    for path, field in _walk_fields(model_cls):
        doc = " ".join((field.description or "(undocumented)").split())
        sub = _submodel(field.annotation)
        if sub is not None:
            optional = " | None" if _type_name(field.annotation).endswith("None") else ""
            lines.append(f"{path}: section {sub.__name__}{optional}")
        else:
            head = f"{path}: {_type_name(field.annotation)}"
            if not field.is_required():
                head += f" = {_default_repr(field)}"
            bounds = _bounds(field)
            if bounds:
                head += f"  ({bounds})"
            lines.append(head)
        lines.append(f"    {doc}")
        extra = field.json_schema_extra
        choices = extra.get("choices") if isinstance(extra, dict) else None
        if isinstance(choices, dict):
            lines += [f"      {name}: {line}" for name, line in choices.items()]
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _default_repr(field: pydantic.fields.FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    try:
        text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=10**6)
    except yaml.representer.RepresenterError:  # models inside a default (a dict of tools)
        plain = pydantic_core.to_jsonable_python(value)
        text = yaml.dump(plain, Dumper=_Dumper, default_flow_style=True, width=10**6)
    return text.removesuffix("\n").removesuffix("\n...")


def _bounds(field: pydantic.fields.FieldInfo) -> str:
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = []
    for meta in field.metadata:
        for attr, sym in symbols.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sym} {value}")
    return ", ".join(out)
