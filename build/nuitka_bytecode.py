"""Nuitka user plugin: the MCP SDK and the packages it needs go into the binary as bytecode.

Compiled to C they were 1,310 C files beside the server's 184, a build many times as long,
most of all for the targets built under emulation. None of them is on the server's hot path:
they serve `nulltickets mcp` and POST /mcp, which run as they do under CPython. OTLP's
protobuf types (opentelemetry.proto) stay compiled, as before.
"""

from __future__ import annotations

from nuitka.plugins.PluginBase import NuitkaPluginBase

# Top-level packages of the MCP SDK and its dependencies.
AS_BYTECODE = frozenset(
    {
        "annotated_types",
        "anyio",
        "click",
        "cryptography",
        "h11",
        "httpcore2",
        "httpx2",
        "idna",
        "jwt",
        "mcp",
        "mcp_types",
        "multipart",
        "pydantic",
        "pydantic_core",
        "pydantic_settings",
        "python_multipart",
        "sniffio",
        "sse_starlette",
        "starlette",
        "truststore",
        "typing_inspection",
        "uvicorn",
    }
)


class NuitkaPluginBytecode(NuitkaPluginBase):
    plugin_name = "nulltickets-bytecode"
    plugin_desc = "Include the MCP SDK and its dependencies as bytecode."

    @staticmethod
    def isAlwaysEnabled() -> bool:
        return True

    def decideCompilation(self, module_name):  # type: ignore[no-untyped-def]
        name = module_name.asString()
        if "-" in name:  # a plugin's load trigger ("pydantic-postLoad"): Nuitka compiles those
            return None
        top = name.partition(".")[0]
        if top in AS_BYTECODE:
            return "bytecode"
        if top == "opentelemetry" and not name.startswith("opentelemetry.proto"):
            return "bytecode"
        return None
