"""The only place that knows HTTP statuses: a map from exception class to status, looked up
along the class's MRO, and the one error envelope every failure is sent in."""

from __future__ import annotations

import logging

import msgspec

from nulltickets import errors as e

log = logging.getLogger("nulltickets.http")

STATUS: dict[type[e.TrackerError], int] = {
    e.InvalidJson: 400,
    e.InvalidRequest: 400,
    e.InvalidLimit: 400,
    e.InvalidCursor: 400,
    e.InvalidLeaseTtl: 400,
    e.MissingParam: 400,
    e.InvalidQuery: 400,
    e.InvalidPipeline: 400,
    e.InvalidRetryPolicy: 400,
    e.InvalidDependency: 400,
    e.IllegalTransition: 400,
    e.ReservedNamespace: 400,
    e.InvalidStage: 400,
    e.StorageQueryError: 400,
    e.Unauthorized: 401,
    e.Forbidden: 403,
    e.NotFound: 404,
    e.PipelineNotFound: 404,
    e.TaskNotFound: 404,
    e.DependencyTaskNotFound: 404,
    e.MethodNotAllowed: 405,
    e.RequestTimeout: 408,
    e.RunNotRunning: 409,
    e.DuplicateName: 409,
    e.DuplicateDependency: 409,
    e.ExpectedStageMismatch: 409,
    e.TaskVersionMismatch: 409,
    e.IdempotencyConflict: 409,
    e.KeysNeedToken: 409,
    e.LeaseSuperseded: 409,
    e.TaskCancelled: 409,
    e.TaskLeased: 409,
    e.TaskFinished: 409,
    e.LeaseExpired: 410,
    e.PayloadTooLarge: 413,
    e.Overloaded: 503,
    e.StorageBusy: 503,
    e.StorageReadOnly: 503,
    e.StorageUnavailable: 503,
    e.McpUnavailable: 503,
    e.StorageFull: 507,
    e.TrackerError: 500,
}

# Headers that go with a status (a busy database or a full server asks the client to come back
# shortly).
EXTRA_HEADERS: dict[int, list[tuple[str, str]]] = {
    # The unread rest of the request cannot be told apart from the next one: close.
    408: [("connection", "close")],
    413: [("connection", "close")],
    503: [("retry-after", "1")],
    507: [("retry-after", "5")],
}


class ErrorDetail(msgspec.Struct):
    code: str
    message: str


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def error_headers(exc: BaseException) -> list[tuple[str, str]]:
    """Headers an error carries beyond its status's: a 405 names the methods the path takes."""
    if isinstance(exc, e.MethodNotAllowed):
        return [("allow", ", ".join(exc.allowed))]
    return []


def status_of(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def error_response(exc: BaseException) -> tuple[int, bytes]:
    """Status and envelope for any exception; unexpected ones are logged, never shown."""
    status = status_of(exc)
    if isinstance(exc, e.TrackerError) and status != 500:
        code, message = exc.code, exc.message
    else:
        log.error("unexpected error", exc_info=exc)
        code, message = "internal_error", "internal error"
    return status, msgspec.json.encode(ErrorBody(ErrorDetail(code, message)))
