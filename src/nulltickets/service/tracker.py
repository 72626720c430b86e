"""The tracker: the rules of every verb, by area, inside one unit of work (a `Backend` and its
time). Each area is a class of its own module; `Tracker` is all of them."""

from __future__ import annotations

from nulltickets.service.artifacts import Artifacts
from nulltickets.service.keys import Keys
from nulltickets.service.leases import Leases
from nulltickets.service.pipelines import Pipelines
from nulltickets.service.reports import Reports
from nulltickets.service.store import Store
from nulltickets.service.tasks import Tasks
from nulltickets.service.verbs import VERBS, Verb


class Tracker(Pipelines, Tasks, Leases, Artifacts, Store, Reports, Keys):
    """Every verb's rules (see `TrackerBase` for its caches and why they are safe)."""


# Every verb of the API: the areas above declared theirs as they were defined, and Service
# (unit_of_work) the few it implements itself, which it adds when it is imported.
TABLE: dict[str, Verb] = VERBS
