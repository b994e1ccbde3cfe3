"""Refusals of the service layer, independent of HTTP.

A service function that refuses a request raises :class:`ServiceError` before anything is stored,
so a refused request changes nothing. ``status`` is the HTTP status the API answers with (the
kinds of refusal and their codes are the ones the REST API documents: 403, 404, 409, 413, 422,
429); ``cloud_hub.api.errors`` turns the error into that response, and the SDK's WebSocket
stream into a ``refused`` frame with the same status and detail.
"""

from __future__ import annotations

__all__ = ["ServiceError", "TooManyTasks"]


class ServiceError(Exception):
    """A request refused whole, nothing stored: ``status`` (the HTTP code the API answers with),
    ``detail`` (one line for the caller), ``headers`` (e.g. ``Retry-After``)."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


class TooManyTasks(ServiceError):
    """429 with Retry-After: nothing was stored; retry the same request (same idempotency key) later."""

    def __init__(self, detail: str, retry_after_s: int) -> None:
        super().__init__(429, detail, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s
