"""Validation against the official AsyncAPI 3.0.0 JSON Schema (vendored in tests/data/asyncapi,
Apache-2.0), and a check that every ``$ref`` of a document resolves inside it."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).parent / "data" / "asyncapi" / "3.0.0.json"


@cache
def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validation_errors(document: Any) -> list[str]:
    """Every error of ``document`` against the AsyncAPI 3.0.0 schema, as readable lines."""
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
        for e in _validator().iter_errors(document)
    ]


def unresolved_refs(document: Any) -> list[str]:
    """The local ``$ref``s of ``document`` that point at nothing."""
    missing: list[str] = []

    def resolve(pointer: str) -> bool:
        node = document
        for part in pointer.lstrip("#/").split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and not resolve(ref):
                missing.append(ref)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    return missing
