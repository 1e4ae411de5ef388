"""JSON schemas for bench/bench_grammar.py: each with a valid and an invalid instance.

The first ten are shaped as the openai SDK sends a pydantic model with `parse()` (strict: every
property required, optional ones as `anyOf [..., null]`, `additionalProperties: false`); the rest
exercise one JSON-schema keyword each. An engine *covers* a schema when it compiles it, accepts
the valid instance token by token and rejects the invalid one (which is well-formed JSON, wrong
only by the keyword under test): a keyword an engine ignores shows up as an accepted invalid one.
"""

from __future__ import annotations

from typing import Any


def strict(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An object schema as the SDK's strict mode writes it."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
        **extra,
    }


NULLABLE_STR = {"anyOf": [{"type": "string"}, {"type": "null"}]}

SCHEMAS: list[dict[str, Any]] = [
    # ---- SDK-shaped (strict) -----------------------------------------------------------------
    {
        "name": "person",
        "schema": strict(
            {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": NULLABLE_STR,
            }
        ),
        "valid": {"name": "Ada", "age": 36, "email": None},
        "invalid": {"name": "Ada", "age": 200, "email": None},
    },
    {
        "name": "address",
        "schema": strict(
            {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["FR", "DE", "US"]},
            }
        ),
        "valid": {"street": "1 Rue", "city": "Paris", "zip": "75001", "country": "FR"},
        "invalid": {"street": "1 Rue", "city": "Paris", "zip": "75001", "country": "IT"},
    },
    {
        "name": "order",
        "schema": strict(
            {
                "id": {"type": "integer"},
                "items": {
                    "type": "array",
                    "items": strict(
                        {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number", "minimum": 0},
                        }
                    ),
                },
                "status": {"type": "string", "enum": ["new", "paid", "shipped"]},
            }
        ),
        "valid": {"id": 7, "items": [{"sku": "A1", "qty": 2, "price": 9.5}], "status": "paid"},
        "invalid": {"id": 7, "items": [{"sku": "A1", "qty": 0, "price": 9.5}], "status": "paid"},
    },
    {
        "name": "weather",
        "schema": strict(
            {
                "location": {"type": "string"},
                "temperature": {"type": "number", "minimum": -100, "maximum": 60},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "conditions": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            }
        ),
        "valid": {"location": "Oslo", "temperature": -3.5, "unit": "celsius", "conditions": []},
        "invalid": {
            "location": "Oslo",
            "temperature": -3.5,
            "unit": "celsius",
            "conditions": ["a", "b", "c", "d"],
        },
    },
    {
        "name": "event",
        "schema": strict(
            {
                "title": {"type": "string"},
                "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "online": {"type": "boolean"},
            }
        ),
        "valid": {"title": "Standup", "attendees": ["Bo"], "online": True},
        "invalid": {"title": "Standup", "attendees": [], "online": True},
    },
    {
        "name": "recipe",
        "schema": strict(
            {
                "name": {"type": "string"},
                "ingredients": {
                    "type": "array",
                    "items": strict(
                        {
                            "item": {"type": "string"},
                            "grams": {"type": "number"},
                        }
                    ),
                },
                "steps": {"type": "array", "items": {"type": "string"}},
                "vegetarian": {"type": "boolean"},
            }
        ),
        "valid": {
            "name": "Tea",
            "ingredients": [{"item": "leaves", "grams": 3}],
            "steps": ["boil", "steep"],
            "vegetarian": True,
        },
        "invalid": {"name": "Tea", "ingredients": [{"item": "leaves"}], "steps": [],
                    "vegetarian": True},  # fmt: skip
    },
    {
        "name": "tree_ref",
        "schema": {
            "$defs": {
                "Node": strict(
                    {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    }
                )
            },
            "$ref": "#/$defs/Node",
        },
        "valid": {"value": 1, "children": [{"value": 2, "children": []}]},
        "invalid": {"value": 1, "children": [{"value": "2", "children": []}]},
    },
    {
        "name": "shape_union",
        "schema": strict(
            {
                "shape": {
                    "anyOf": [
                        strict({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
                        strict(
                            {
                                "kind": {"const": "rect"},
                                "w": {"type": "number"},
                                "h": {"type": "number"},
                            }
                        ),
                    ]
                }
            }
        ),
        "valid": {"shape": {"kind": "rect", "w": 2, "h": 3}},
        "invalid": {"shape": {"kind": "circle", "w": 2, "h": 3}},
    },
    {
        "name": "settings",
        "schema": strict(
            {
                "debug": {"type": "boolean"},
                "level": {"type": "integer", "enum": [1, 2, 3]},
                "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "owner": NULLABLE_STR,
            }
        ),
        "valid": {"debug": False, "level": 2, "ratio": 0.25, "owner": "ops"},
        "invalid": {"debug": False, "level": 2, "ratio": 0, "owner": "ops"},
    },
    {
        "name": "code_len",
        "schema": strict({"code": {"type": "string", "minLength": 3, "maxLength": 6}}),
        "valid": {"code": "AB12"},
        "invalid": {"code": "AB"},
    },
    # ---- one keyword each ----------------------------------------------------------------------
    {
        "name": "optional_properties",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        "valid": {"a": 1},
        "invalid": {"b": "x"},
    },
    {
        "name": "additional_properties_schema",
        "schema": {"type": "object", "additionalProperties": {"type": "integer"}},
        "valid": {"x": 1, "y": 2},
        "invalid": {"x": "1"},
    },
    {
        "name": "one_of",
        "schema": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "valid": "s",
        "invalid": 1.5,
    },
    {
        "name": "all_of",
        "schema": {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
            ]
        },
        "valid": {"a": 1, "b": 2},
        "invalid": {"a": 1},
    },
    {
        "name": "format_date_time",
        "schema": {"type": "string", "format": "date-time"},
        "valid": "2024-05-01T12:00:00Z",
        "invalid": "yesterday",
    },
    {
        "name": "format_email",
        "schema": {"type": "string", "format": "email"},
        "valid": "a@b.io",
        "invalid": "not an email",
    },
    {
        "name": "format_uuid",
        "schema": {"type": "string", "format": "uuid"},
        "valid": "123e4567-e89b-12d3-a456-426614174000",
        "invalid": "123",
    },
    {
        "name": "multiple_of",
        "schema": {"type": "integer", "multipleOf": 5},
        "valid": 15,
        "invalid": 7,
    },
    {
        "name": "min_max_properties",
        "schema": {"type": "object", "additionalProperties": {"type": "integer"},
                   "minProperties": 2, "maxProperties": 3},  # fmt: skip
        "valid": {"a": 1, "b": 2},
        "invalid": {"a": 1},
    },
    {
        "name": "pattern_properties",
        "schema": {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                   "additionalProperties": False},  # fmt: skip
        "valid": {"n_a": 1},
        "invalid": {"x": 1},
    },
    {
        "name": "prefix_items",
        "schema": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}],
                   "items": False},  # fmt: skip
        "valid": [1.5, "a"],
        "invalid": ["a", 1.5],
    },
    {
        "name": "unique_items",
        "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "valid": [1, 2],
        "invalid": [1, 1],
    },
    {
        "name": "if_then_else",
        "schema": {
            "type": "object",
            "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
            "if": {"properties": {"kind": {"const": "num"}}},
            "then": {"required": ["n"]},
        },
        "valid": {"kind": "num", "n": 1},
        "invalid": {"kind": "num"},
    },
    {
        "name": "not",
        "schema": {"type": "integer", "not": {"const": 3}},
        "valid": 4,
        "invalid": 3,
    },
    {
        "name": "enum_mixed",
        "schema": {"enum": [1, "a", None, True]},
        "valid": None,
        "invalid": False,
    },
    {
        "name": "const_object",
        "schema": {"const": {"v": 1}},
        "valid": {"v": 1},
        "invalid": {"v": 2},
    },
    {
        "name": "json_object",
        "schema": {"type": "object"},
        "valid": {"any": [1, {"thing": None}]},
        "invalid": [1],
    },
    {
        "name": "large_enum",
        "schema": {"type": "string", "enum": [f"item_{i:03d}" for i in range(200)]},
        "valid": "item_117",
        "invalid": "item_999",
    },
    {
        "name": "many_properties",
        "schema": strict({f"field_{i}": {"type": "integer"} for i in range(40)}),
        "valid": {f"field_{i}": i for i in range(40)},
        "invalid": {f"field_{i}": i for i in range(39)},
    },
    {
        "name": "deep_nesting",
        "schema": strict({"a": strict({"b": strict({"c": strict({"d": strict(
            {"e": strict({"f": {"type": "integer"}})})})})})}),  # fmt: skip
        "valid": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}},
        "invalid": {"a": {"b": {"c": {"d": {"e": {"f": "1"}}}}}},
    },
]
