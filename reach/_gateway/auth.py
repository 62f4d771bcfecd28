"""Bearer tokens with scopes, as FastAPI dependencies (and a plain check for pieces that
are not FastAPI routes).

No token configured: every request may do everything; the settings then keep the gateway
on loopback. Tokens configured: no or an unknown token is 401, a known token without the
scope is 403. The SHA-256 digests of tokens are compared, in constant time and each one,
so timing tells neither a token nor its length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

from starlette.requests import HTTPConnection

from .._tokens import CHALLENGE, Scope, Tokens
from ..errors import Unauthorized
from .errors import EdgeError

__all__ = ["CALLER_DIGITS", "OPEN_CALLER", "Auth", "caller_id", "scoped_key"]

#: who every caller is on a gateway without tokens
OPEN_CALLER = "open"
#: hex digits of a token's digest in ``caller_id`` (with the colon, 13 characters)
CALLER_DIGITS = 12


class Auth:
    """Who may do what, from ``GatewaySettings.tokens``."""

    def __init__(self, tokens: dict[str, frozenset[Scope]]) -> None:
        self._tokens = Tokens(tokens)

    @property
    def open(self) -> bool:
        return self._tokens.open

    def scopes_of(self, authorization: str | None) -> frozenset[Scope]:
        """The scopes an ``Authorization`` header grants; ``EdgeError`` 401 for none."""
        try:
            return self._tokens.admit(authorization)
        except Unauthorized as exc:
            raise EdgeError(401, exc.code, exc.message, headers=dict(CHALLENGE)) from None

    def caller(self, authorization: str | None) -> str:
        """``caller_id`` of an admitted request: ``open`` on an open gateway."""
        return OPEN_CALLER if self.open else caller_id(authorization)

    def check(self, authorization: str | None, scope: Scope) -> None:
        """Raise ``EdgeError`` (401 or 403) unless the header's token has ``scope``."""
        scopes = self.scopes_of(authorization)
        if scope not in scopes and Scope.ADMIN not in scopes:
            raise EdgeError(
                403, "forbidden", f"this token lacks the {scope.value!r} scope", headers={}
            )

    def require(self, scope: Scope | None) -> Callable[[HTTPConnection], Awaitable[None]]:
        """A FastAPI dependency: ``dependencies=[Depends(auth.require(Scope.CALL))]``.
        ``None``: any valid token (reading the routing table)."""

        async def dependency(conn: HTTPConnection) -> None:
            header = conn.headers.get("authorization")
            if scope is None:
                self.scopes_of(header)
            else:
                self.check(header, scope)

        return dependency


def caller_id(authorization: str | None) -> str:
    """Who is asking, for scoping what callers name themselves (idempotency keys): a short
    digest of the bearer token, ``open`` without one. Only for a request ``Auth`` let in."""
    _, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if not token:
        return OPEN_CALLER
    return hashlib.sha256(token.encode()).hexdigest()[:CALLER_DIGITS]


def scoped_key(caller: str, key: str) -> str:
    """An idempotency key as stored: the caller's, so two callers never share a task."""
    return f"{caller}:{key}"
