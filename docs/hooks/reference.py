"""mkdocs hook: the reference pages that are rendered from the code when the site is built.

`reference/api.md` gets the server's OpenAPI document (`nulltickets.http.openapi.document()`,
built in-process, the same bytes `GET /openapi.json` serves) as operations by tag and schemas;
`reference/errors.md` gets every error class of `nulltickets.errors` with its code and status
(`nulltickets.http.errors.STATUS`). Each page holds a marker the hook replaces, so the prose
around it stays hand-written.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

API_MARKER = "<!-- reference: openapi -->"
ERRORS_MARKER = "<!-- reference: errors -->"
METHODS = ("get", "head", "post", "put", "patch", "delete")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#schema-{name.lower()})"
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return " or ".join(_schema_type(s) for s in schema[union])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if kind is None:
        return "any JSON"
    if isinstance(kind, list):
        return " or ".join(f"`{k}`" for k in kind)
    return f"`{kind}`"


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", "", op.get("summary", ""), ""]
    access = op.get("x-access")
    if op.get("security") == []:
        out.append("Access: open (no token needed).")
    elif access:
        out.append("Access: " + ", ".join(f"`{a}`" for a in access) + ".")
    out.append("")
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | meaning |", "|---|---|---|---|---|"]
        for p in params:
            out.append(
                f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} "
                f"| {'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        out += [f"Request body: {_schema_type(schema)}.", ""]
    out += ["| status | answer |", "|---|---|"]
    for status, answer in op.get("responses", {}).items():
        content = answer.get("content", {}).get("application/json", {}).get("schema")
        what = _cell(answer.get("description", ""))
        if content is not None and "ErrorBody" not in json.dumps(content):
            what += f": {_schema_type(content)}"
        out.append(f"| {status} | {what} |")
    out.append("")
    return out


def render_api(document: bytes) -> str:
    doc = json.loads(document)
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, ops in doc["paths"].items():
        for method in METHODS:
            if method in ops:
                tag = (ops[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, ops[method]))
    out = [f"OpenAPI {doc['openapi']}, nulltickets {doc['info']['version']}.", ""]
    for tag, ops in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for path, method, op in ops:
            out += _operation(path, method, op)
    out += ["## Schemas", ""]
    for name, schema in doc["components"]["schemas"].items():
        out += [f"### {name} {{#schema-{name.lower()}}}", ""]
        if schema.get("description"):  # the type's docstring: what its fields mean together
            out += [" ".join(schema["description"].split()), ""]
        props = schema.get("properties")
        if not props:
            out += [f"{_schema_type(schema)}.", ""]
            continue
        required = set(schema.get("required", ()))
        out += ["| field | type | required |", "|---|---|---|"]
        for field, spec in props.items():
            out.append(
                f"| `{field}` | {_schema_type(spec)} | {'yes' if field in required else 'no'} |"
            )
        out.append("")
    return "\n".join(out)


def render_errors() -> str:
    from nulltickets import errors
    from nulltickets.http.errors import STATUS

    def status(cls: type[errors.TrackerError]) -> int:
        return next(STATUS[k] for k in cls.__mro__ if k in STATUS)

    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.TrackerError)
    ]
    classes.sort(key=lambda c: (status(c), c.code, c.__name__))
    out = ["| status | code | class | default message |", "|---:|---|---|---|"]
    for c in classes:
        doc = " ".join((c.__doc__ or "").split())
        out.append(f"| {status(c)} | `{c.code}` | `{c.__name__}` | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if API_MARKER in markdown:
        from nulltickets.http import openapi

        markdown = markdown.replace(API_MARKER, render_api(openapi.document()))
    if ERRORS_MARKER in markdown:
        markdown = markdown.replace(ERRORS_MARKER, render_errors())
    return markdown
