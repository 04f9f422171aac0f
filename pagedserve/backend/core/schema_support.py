"""The JSON Schema keywords structured outputs cannot enforce: the grammar engine (xgrammar 0.2.8) compiles
a schema holding them but ignores them, so such a schema is refused, as vLLM's xgrammar backend refuses it,
rather than answered with JSON that breaks it."""

from __future__ import annotations

from typing import Any

# Keywords ignored whatever their value.
_IGNORED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "dependencies")
# Keywords holding one schema, or a map or list of them, that the walk goes into.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
              "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def unenforceable_keyword(schema: Any, path: str = "") -> str | None:
    """'keyword at path' of the first keyword in `schema` the grammar cannot enforce, else None."""
    if not isinstance(schema, dict):
        return None
    where = path or "the root"
    for keyword in _IGNORED:
        if keyword in schema:
            return f"'{keyword}' at {where}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with several schemas at {where}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {where}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"'multipleOf' on a non-integer at {where}"
    return _in_subschemas(schema, path)


def _in_subschemas(schema: dict, path: str) -> str | None:
    children: list[tuple[str, Any]] = [(f"{path}/{key}", schema[key]) for key in _SUBSCHEMA if key in schema]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{path}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    for child_path, child in children:
        found = unenforceable_keyword(child, child_path)
        if found:
            return found
    return None
