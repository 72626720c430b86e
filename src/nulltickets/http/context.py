"""What every handler is given besides its request: the service and the server's parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nulltickets.http.slowdown import Slowdown
from nulltickets.service import Service

if TYPE_CHECKING:
    from nulltickets.http.metrics import Metrics
    from nulltickets.http.sse import StreamHub
    from nulltickets.mcp.http import Bridge
    from nulltickets.server.heap import Collector
    from nulltickets.service.retention import RetentionJob


@dataclass
class Context:
    service: Service
    admin_token: str | None
    hub: StreamHub | None = None  # GET /events/stream
    metrics: Metrics | None = None  # GET /metrics
    collector: Collector | None = None  # the garbage collector's settings and timings
    slowdown: Slowdown = field(default_factory=Slowdown)  # wrong tokens and keys wait
    mcp: Bridge | None = None  # POST /mcp, started by its first request
    retention: RetentionJob | None = None  # the background pruning (--retention)
