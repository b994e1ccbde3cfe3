"""The HTTP face of the service layer's refusals: a :class:`~cloud_hub.service.errors.ServiceError`
becomes the response FastAPI gives an ``HTTPException`` with the same status, detail and headers
(``{"detail": ...}``), so moving the rules out of ``api/`` changed no answer a client sees.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from cloud_hub.service.errors import ServiceError

__all__ = ["http_error", "service_error_response"]


def http_error(exc: ServiceError) -> HTTPException:
    """The ``HTTPException`` a route would have raised for this refusal."""
    return HTTPException(exc.status, exc.detail, headers=exc.headers)


async def service_error_response(request: Request, exc: Exception) -> JSONResponse:
    """The app's handler for :class:`ServiceError` (``app.add_exception_handler``)."""
    assert isinstance(exc, ServiceError)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)
