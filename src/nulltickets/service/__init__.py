"""The service: every verb as one unit of work on the database, with no HTTP in it.

- `verbs`: the table of verbs; each is declared once, beside its implementation in an area.
- `unit_of_work`: `Service`, which runs a verb as one transaction, idempotency included.
- the areas (`pipelines`, `tasks`, `leases`, `artifacts`, `store`, `reports`, `keys`) hold the
  rules a unit of work applies; `Tracker` is all of them.
"""

from __future__ import annotations

from nulltickets.service.base import RESERVED_NAMESPACE
from nulltickets.service.tracker import Tracker
from nulltickets.service.unit_of_work import Answer, Idem, Outcome, Service
from nulltickets.service.verbs import VERBS, Kind, Verb

__all__ = [
    "RESERVED_NAMESPACE",
    "VERBS",
    "Answer",
    "Idem",
    "Kind",
    "Outcome",
    "Service",
    "Tracker",
    "Verb",
]
