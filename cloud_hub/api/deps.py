"""The API's shared dependencies: the hub (``HubDep``) and the signed-in user (``UserDep``), and the
error responses every route documents. Routers and ``cloud_hub.api.app`` import them from here.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cloud_hub.api.schemas import ErrorOut
from cloud_hub.globus_auth import GlobusUnavailable
from cloud_hub.service.hub import Hub

__all__ = ["ERRORS", "HubDep", "UserDep", "current_user", "hub_of"]

_bearer = HTTPBearer(auto_error=False)

#: Error responses every route documents in the OpenAPI spec.
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut},
    403: {"model": ErrorOut},
    404: {"model": ErrorOut},
    409: {"model": ErrorOut},
    413: {"model": ErrorOut},
    422: {"model": ErrorOut},
}


def hub_of(request: Request) -> Hub:
    return request.app.state.hub  # type: ignore[no-any-return]


async def current_user(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    if cred is None or cred.scheme.lower() != "bearer":
        raise HTTPException(401, "missing API token (Authorization: Bearer ...)", headers={"WWW-Authenticate": "Bearer"})
    try:
        uid, why = await hub_of(request).auth(cred.credentials)
    except GlobusUnavailable as exc:  # the token is neither good nor bad yet: the client may retry
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
    if uid is None:
        raise HTTPException(401, why, headers={"WWW-Authenticate": "Bearer"})
    return uid


HubDep = Annotated[Hub, Depends(hub_of)]
UserDep = Annotated[str, Depends(current_user)]
