"""Bearer API keys with scopes. A missing or unknown key is 401; a key without the route's scope is 403."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from converters import errors as E
from converters.errors import ExportError

from ..store.keys import ApiKey

_bearer = HTTPBearer(auto_error=False, description="an API key from `nucleus-export keys create`")


def require(scope: str):
    def dependency(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> ApiKey:
        if creds is None:
            raise ExportError(E.UNAUTHORIZED, "this route needs an API key: send Authorization: Bearer nxk_….")
        key = request.app.state.services.keys.authenticate(creds.credentials)
        if key is None:
            raise ExportError(E.UNAUTHORIZED, "the API key is unknown or revoked; create one with `nucleus-export keys create`.")
        if scope not in key.scopes:
            raise ExportError(E.FORBIDDEN, f"this route needs the {scope!r} scope; the key has {', '.join(key.scopes)}.")
        return key

    return Depends(dependency)
