"""JSON-schema keywords the constrained decoder enforces, and a typed refusal of the rest.

llguidance silently ignores keywords it does not know (measured with 1.9.1: `contentEncoding`,
`discriminator`, `nullable` compile without error), which would turn a request into an
unconstrained success. So a schema is checked against the keywords below first; anything else is
an UnsupportedSchemaError naming the keyword and where it sits (the gateway answers 400).
"""

from __future__ import annotations

from typing import Any

# Keywords llguidance compiles into the grammar (verified against 1.9.1 by tests). `oneOf` is
# absent: llguidance can only approximate it with anyOf, which would accept invalid documents.
_CONSTRAINING = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "patternProperties",
        "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minLength", "maxLength", "pattern", "format",
    }
)
# Annotations: no effect on validity, safe to ignore.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly", "writeOnly", "deprecated"}
)
# String formats llguidance 1.9.1 compiles (others fail its validation: "Unknown format").
_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
# Keywords whose value is a schema, a list of schemas, or a map of schemas.
_SUBSCHEMA = frozenset({"items", "additionalProperties"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


class GrammarRequestError(ValueError):
    """The request asks for a constraint that cannot be enforced (HTTP 400)."""


class UnsupportedSchemaError(GrammarRequestError):
    def __init__(self, keyword: str, path: str, detail: str = "") -> None:
        self.keyword = keyword
        self.path = path
        super().__init__(f"unsupported JSON schema keyword {keyword!r} at {path}" + (f": {detail}" if detail else ""))


def check_schema(schema: Any, path: str = "$") -> None:
    """Raise UnsupportedSchemaError for the first keyword that would not be enforced."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UnsupportedSchemaError("<schema>", path, "a schema must be an object or a boolean")
    for keyword, value in schema.items():
        if keyword in _ANNOTATIONS:
            continue
        if keyword not in _CONSTRAINING:
            raise UnsupportedSchemaError(keyword, path)
        if keyword == "format" and value not in _FORMATS:
            raise UnsupportedSchemaError("format", path, f"format {value!r} is not enforced")
        if keyword in _SUBSCHEMA:
            check_schema(value, f"{path}.{keyword}")
        elif keyword in _SUBSCHEMA_LISTS:
            if not isinstance(value, list):
                raise UnsupportedSchemaError(keyword, path, "expected a list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}.{keyword}[{i}]")
        elif keyword in _SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise UnsupportedSchemaError(keyword, path, "expected an object of schemas")
            for name, sub in value.items():
                check_schema(sub, f"{path}.{keyword}.{name}")
