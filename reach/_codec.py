"""Payload encoding, typed decoding, and error replies: the msgspec boundary."""

from __future__ import annotations

import functools
import re
import time
from typing import Any

import msgspec

from .errors import ReachError, RemoteError, error_for_code
from .wire import ERROR_CODES, ErrorBody, Header

_json_encoder = msgspec.json.Encoder()
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_error_decoder = msgspec.json.Decoder(ErrorBody)
encode_json = _json_encoder.encode
#: one encoding per value (object keys sorted), for comparing schemas and shapes by bytes
canonical = msgspec.json.Encoder(order="sorted").encode
#: the protocol's own codes -> (Nats-Service-Error-Code, retryable); fixed by the protocol
_PROTOCOL: dict[str, tuple[int, bool]] = {str(k): v for k, v in ERROR_CODES.items()}
_APP_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# The client's own outcome names (reach.errors.Attempt.outcome): no application code may be one.
_RESERVED = frozenset({"ok", "error", "no_responders", "refused"})


def _app_code(code: str) -> bool:
    """A valid application code: snake_case, at most 64 characters, not reserved."""
    return code not in _RESERVED and _APP_CODE.fullmatch(code) is not None


def now_ms() -> int:
    return int(time.time() * 1000)


def encode_payload(value: Any) -> bytes:
    """bytes pass through untouched, None is an empty body, anything else is JSON."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    try:
        return _json_encoder.encode(value)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON: {exc}") from exc


class PayloadDecoder:
    """Decodes a body into the type a handler or caller asked for."""

    __slots__ = ("_decoder", "_raw", "type")

    def __init__(self, type_: Any) -> None:
        self.type = type_
        self._raw = type_ is bytes
        self._decoder: msgspec.json.Decoder[Any] = (
            _any_decoder if type_ is Any or self._raw else msgspec.json.Decoder(type_)
        )

    def __call__(self, data: bytes) -> Any:
        """Raise msgspec.DecodeError (a ValidationError names the field) on bad input."""
        if self._raw:
            return data
        if not data:
            if self._decoder is _any_decoder:
                return None
            data = b"null"
        return self._decoder.decode(data)


@functools.cache
def decoder_for(type_: Any) -> PayloadDecoder:
    return PayloadDecoder(type_)


def wire_error(exc: RemoteError) -> tuple[str, int, bool] | None:
    """The ``(code, status, retryable)`` a handler's refusal is sent with; None when its code
    is not a valid wire code (``[a-z][a-z0-9_]*``, at most 64 characters, not one of the
    client's outcome names).

    Protocol codes keep the protocol's status and retryability; an application code takes
    the exception's ``status`` (400..599, else 500) and ``retryable``.
    """
    code = exc.code
    if not isinstance(code, str):
        return None
    known = _PROTOCOL.get(code)
    if known is not None:
        return code, known[0], known[1]
    if not _app_code(code):
        return None
    status = exc.status
    if type(status) is not int or not 400 <= status <= 599:
        status = 500
    return code, status, exc.retryable is True


def error_reply(
    code: str, message: str, agent_id: str = "", *, status: int = 500, retryable: bool = False
) -> tuple[bytes, dict[str, str]]:
    """Body and headers of an error reply (NATS services convention plus our JSON body).

    A protocol code takes its status and retryability from the protocol table; any other
    (application) code is sent with ``status`` and ``retryable`` as given.
    """
    known = _PROTOCOL.get(code)
    if known is not None:
        status, retryable = known
    body = _json_encoder.encode(ErrorBody(code=code, message=message, retryable=retryable))
    headers = {Header.SERVICE_ERROR_CODE: str(status), Header.SERVICE_ERROR: message[:200]}
    if agent_id:
        headers[Header.AGENT] = agent_id
    return body, headers


def error_from_reply(
    data: bytes, headers: dict[str, str], *, capability: str, request_id: str
) -> ReachError:
    """Turn an error reply into the matching exception; tolerate foreign, bodiless errors."""
    agent_id = headers.get(Header.AGENT, "")
    try:
        body = _error_decoder.decode(data)
        code, message, retryable = body.code, body.message, body.retryable
        if code not in _PROTOCOL and not _app_code(code):
            code = "failed"  # not a code anyone may branch on
    except msgspec.DecodeError:
        # A plain NATS service (or a foreign agent) may send only the headers.
        status = headers.get(Header.SERVICE_ERROR_CODE, "500")
        message = headers.get(Header.SERVICE_ERROR, "") or f"error {status}"
        code = {
            "400": "bad_request",
            "404": "capability_not_found",
            "408": "timeout",
            "429": "resource_exhausted",
            "503": "agent_unavailable",
        }.get(status, "failed")
        retryable = code in ("timeout", "resource_exhausted", "agent_unavailable")
    cls = error_for_code(code)
    err: RemoteError = cls(
        f"{capability}: {message}" if capability else message,
        capability=capability,
        agent_id=agent_id,
        request_id=request_id,
        retryable=retryable,
        code=code,  # an application code stays itself (class HandlerFailed)
    )
    return err
