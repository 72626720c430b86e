"""The store: JSON values by namespace and key, and full-text search over them."""

from __future__ import annotations

from nulltickets import errors as e
from nulltickets.domain import commands, model
from nulltickets.domain.commands import (
    PutValue,
    compact_json,
)
from nulltickets.domain.model import (
    Access,
    NamespaceSummary,
    SearchHit,
    StoreEntry,
)
from nulltickets.domain.search import search_terms
from nulltickets.errors import (
    InvalidQuery,
    MissingParam,
    NotFound,
    ReservedNamespace,
    StorageQueryError,
)
from nulltickets.service import params as p
from nulltickets.service.base import (
    RESERVED_NAMESPACE,
    TrackerBase,
    _page,
)
from nulltickets.service.verbs import Param, Tool, page, verb
from nulltickets.storage.backend import Backend


class Store(TrackerBase):
    # --- store ---------------------------------------------------------------------------------

    @verb(
        "PUT",
        "/store/{namespace}/{key+}",
        "Store a JSON value under a key.",
        client="store_put",
        request=commands.PutValue,
        status=204,
        errors=(e.InvalidJson, e.ReservedNamespace),
        access=Access.AGENT,
        tag="store",
        tool=Tool(
            "store_put",
            "Write a value (any JSON) to the shared store, under a namespace and a key.",
        ),
    )
    def put_value(self, b: Backend, namespace: str, key: str, cmd: PutValue, now: int) -> None:
        if namespace == RESERVED_NAMESPACE:
            raise ReservedNamespace('the namespace "search" is reserved')
        b.put_value(namespace, key, compact_json(cmd.value, "null") or "null", now)

    @verb(
        "GET",
        "/store/{namespace}/{key+}",
        "Read a stored value.",
        client="store_get",
        response=model.StoreEntry,
        errors=(e.NotFound,),
        tag="store",
        tool=Tool("store_get", "Read a value of the shared store."),
    )
    def get_value(self, b: Backend, namespace: str, key: str) -> StoreEntry:
        entry = b.get_value(namespace, key)
        if entry is None:
            raise NotFound("no value under this key")
        return entry

    @verb(
        "DELETE",
        "/store/{namespace}/{key+}",
        "Delete a key (always 204).",
        client="store_delete",
        status=204,
        access=Access.AGENT,
        tag="store",
        tool=Tool("store_delete", "Delete a value of the shared store."),
    )
    def delete_value(self, b: Backend, namespace: str, key: str) -> None:
        b.delete_value(namespace, key)

    @verb(
        "GET",
        "/store/{namespace}",
        "Every entry of a namespace by key.",
        client="store_list",
        response=list[model.StoreEntry],
        tag="store",
    )
    def list_namespace(self, b: Backend, namespace: str) -> list[StoreEntry]:
        return b.list_namespace(namespace)

    @verb(
        "GET",
        "/namespaces",
        "The store's namespaces by name, with how many keys each holds and when one last "
        "changed (not under /store/: GET /store/{namespace} lists a namespace's entries).",
        response=model.NamespacePage,
        errors=(e.InvalidLimit,),
        query=(
            Param("limit", "Page size, 1..1000 (default 100).", "integer", p.limit(100)),
            Param(
                "cursor",
                "The next_cursor of the previous page.",
                parse=lambda raw: raw or "",
                arg="after",
            ),
        ),
        extra=True,
        tag="store",
        answer=page,
    )
    def list_namespaces(
        self, b: Backend, after: str, limit: int
    ) -> tuple[list[NamespaceSummary], str | None]:
        rows = b.list_namespaces(after, limit + 1)
        return _page(rows, limit, lambda n: n.namespace)

    @verb(
        "DELETE",
        "/store/{namespace}",
        "Delete a whole namespace (always 204).",
        client="store_delete_namespace",
        status=204,
        tag="store",
    )
    def delete_namespace(self, b: Backend, namespace: str) -> None:
        b.delete_namespace(namespace)

    @verb(
        "GET",
        "/store/search",
        "Full-text search over the store, best match first (bm25), with snippets.",
        name="search_store",
        client="store_search",
        response=list[model.SearchHit],
        errors=(e.MissingParam, e.InvalidQuery, e.InvalidLimit),
        query=(
            Param("q", "Words to find (every word must match; operators are literal).", arg="text"),
            Param("namespace", "Only this namespace."),
            Param(
                "limit",
                "At most this many results, 1..1000 (default 10).",
                "integer",
                arg="limit_text",
            ),
            Param("filter_path", "JSON path into the value, e.g. $.status."),
            Param("filter_value", "Keep values whose filter_path has this text form."),
        ),
        tag="store",
        tool=Tool("store_search", "Search the shared store's values by words (full-text)."),
    )
    def search(
        self,
        b: Backend,
        *,
        text: str | None,
        namespace: str | None,
        filter_path: str | None,
        filter_value: str | None,
        limit_text: str | None = None,
    ) -> list[SearchHit]:
        if text is None:
            raise MissingParam("q is required")
        limit = p.search_limit(limit_text) if text.strip() else 10
        terms = search_terms(text)
        if not terms:
            raise InvalidQuery("q has no search term")
        if filter_path is not None and not filter_path.startswith("$"):
            raise InvalidQuery("filter_path must be a JSON path such as $.status")
        try:
            return b.search_store(terms, namespace, filter_path, filter_value, limit)
        except StorageQueryError as exc:
            raise InvalidQuery(f"cannot search with this filter_path: {exc}") from None
