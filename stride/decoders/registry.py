"""Decoders by name. A new strategy registers here with one line."""

from __future__ import annotations

from typing import Any, NamedTuple

from stride.decoders import catalog
from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import (
    Decoder,
    DecoderError,
    DecodersConfig,
    check_options,
    options_schemas,
)
from stride.decoders.refine import Refine
from stride.decoders.speculative import Speculative
from stride.engine.engine import Engine

DECODERS: dict[str, type[Decoder]] = {
    Autoregressive.name: Autoregressive,
    Speculative.name: Speculative,
    Refine.name: Refine,
}


class Choice(NamedTuple):
    """A request's decoder, parsed once where the request arrives."""

    name: str
    options: dict[str, Any]


def parse_spec(spec: Any) -> Choice:
    """`"ar"` or `{"type": "ar", ...options}` → its `Choice`; a variant's name (`"eagle"`,
    `"refine/lookahead"`: `catalog.shorthand`) is its decoder with that option.

    Raises DecoderError for an unknown decoder, or options of the wrong name, type or range
    (`base.check_options`); what depends on the server is checked at admission.
    """
    if isinstance(spec, str):
        name, options = catalog.shorthand(spec) or (spec, {})
    elif isinstance(spec, dict):
        options = dict(spec)
        name = options.pop("type", None)
        if not isinstance(name, str):
            raise DecoderError("decoder object needs a string field 'type'")
    else:
        raise DecoderError("decoder must be a name or an object with a 'type' field")
    if name not in DECODERS:
        valid = ", ".join((*DECODERS, *catalog.shorthands()))
        raise DecoderError(f"unknown decoder {name!r}; valid decoders: {valid}")
    check_options(DECODERS[name], options)
    return Choice(name, options)


def spec_schema() -> dict[str, Any]:
    """The JSON schema of a `decoder` field: a name, or an object of a decoder's options."""
    objects = []
    for name, cls in DECODERS.items():
        for schema in options_schemas(cls):
            properties = {"type": {"const": name}, **schema.get("properties", {})}
            required = ["type", *schema.get("required", [])]
            shape = {k: v for k, v in schema.items() if k not in ("title", "description")}
            objects.append({**shape, "properties": properties, "required": required})
    names = [*DECODERS, *catalog.shorthands()]
    return {"oneOf": [{"type": "string", "enum": names}, *objects]}


def build_decoders(engine: Engine, config: DecodersConfig | None = None) -> dict[str, Decoder]:
    """One instance of every registered decoder, set up for `engine`."""
    config = config or DecodersConfig()
    return {name: cls.from_config(engine, config) for name, cls in DECODERS.items()}
