"""JSON-schema keywords xgrammar would silently ignore: named in a 400 instead.

Measured on xgrammar 0.2.8: it enforces type, properties/required/additionalProperties,
patternProperties, propertyNames, min/maxProperties, dependentRequired, items/prefixItems,
min/maxItems, uniqueItems, contains, enum/const, anyOf/oneOf, $ref/$defs, numeric bounds,
multipleOf, min/maxLength, pattern and the formats in ENFORCED_FORMATS; it ignores `not`,
if/then/else, allOf with several subschemas and the keywords in UNSUPPORTED. A schema using those
would produce outputs that fail validation, so it is refused.

`oneOf` is compiled as anyOf (as vLLM and xgrammar do): outputs match at least one branch, which is
exactly one for the discriminated unions Pydantic writes. `format` values outside ENFORCED_FORMATS are
annotations (JSON Schema 2020-12's default for `format`) and are not enforced.
"""

from __future__ import annotations

from typing import Any, Iterator

UNSUPPORTED = ("not", "if", "then", "else", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
               "$dynamicRef", "$recursiveRef")
ENFORCED_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid")
# keyword -> how its value holds subschemas
_ONE = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_keywords(schema: Any) -> list[str]:
    """Keywords in `schema` (at schema positions only, never inside enum/const/default) that would be ignored."""
    found: list[str] = []
    for node in _subschemas(schema):
        found.extend(k for k in UNSUPPORTED if k in node)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append("allOf (with more than one subschema)")
    return sorted(set(found))


def _subschemas(schema: Any) -> Iterator[dict]:
    """Every schema object reachable from `schema` through schema-valued keywords (iterative: no recursion limit)."""
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(node.get(k) for k in _ONE)
        for k in _LIST:
            if isinstance(node.get(k), list):
                stack.extend(node[k])
        for k in _MAP:
            if isinstance(node.get(k), dict):
                stack.extend(node[k].values())
