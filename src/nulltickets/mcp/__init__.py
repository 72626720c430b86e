"""The MCP server: the agent loop, the store and the queue as tools for agents (Claude Code,
Codex, Cursor, agent frameworks), made from the table of verbs.

Two transports carry the same tools: `nulltickets mcp` on stdio, a client of a server's HTTP
API (`stdio.py`), and `/mcp` on the server itself, Streamable HTTP, under the same keys as the
API (`http.py`). The protocol is the official MCP SDK's; `tools.py` makes the tools from the
table, `server.py` hands them to the SDK, and a `Port` carries each call out.
"""
