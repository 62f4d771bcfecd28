"""Settings as a program's edge builds them: a bad value is one ``ConfigurationError``
line, not pydantic's report (several lines per error, a link to its docs, the values given).

Each problem names the environment variable (``REACH_GATEWAY_TOKENS``; with a settings
file, also its key), says what is wrong, and for a value of the wrong shape shows one that
is right (a field's ``examples``). Values are never shown: a token or a password may be
among them, and so are the keys of a field hidden from ``repr`` (the tokens themselves).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from .errors import ConfigurationError

__all__ = ["explain_settings", "load_settings"]

S = TypeVar("S", bound=BaseSettings)

#: pydantic-settings' words for a value it could not parse as JSON (a dict, a list)
_UNPARSED = re.compile(r'error (?:parsing|getting) value for field "(?P<field>[^"]+)"')


def load_settings(cls: type[S], **values: Any) -> S:
    """``cls(**values)``; ``ConfigurationError`` saying what to fix when a value is bad."""
    try:
        return cls(**values)
    except ValidationError as exc:
        raise ConfigurationError(explain_settings(exc, cls)) from None
    except SettingsError as exc:  # a value that had to be JSON and is not
        raise ConfigurationError(_unparsed(exc, cls)) from None


def explain_settings(exc: ValidationError, cls: type[BaseSettings]) -> str:
    """Every problem of ``exc``, in one line."""
    problems = []
    for e in exc.errors(include_url=False, include_input=False):
        loc = [str(p) for p in e["loc"]]
        what = str(e["msg"]).removeprefix("Value error, ")
        if not loc:  # a check of several settings: its message names them
            problems.append(what)
            continue
        name, inner = loc[0], loc[1:]
        field = cls.model_fields.get(name)
        where = _where(cls, name)
        if inner and field is not None and field.repr:
            where += f" at {'.'.join(inner)!r}"
        if str(e["type"]).endswith(("_type", "_parsing")):
            what += _example(cls, name)
        problems.append(f"{where}: {what}")
    return "invalid settings: " + "; ".join(problems)


def _unparsed(exc: SettingsError, cls: type[BaseSettings]) -> str:
    found = _UNPARSED.search(str(exc))
    if found is None:
        return f"invalid settings: {exc}"
    name = found["field"]
    cause = exc.__cause__
    why = f" ({' '.join(str(cause).split())})" if cause is not None else ""
    return f"invalid settings: {_where(cls, name)}: not valid JSON{why}{_example(cls, name)}"


def _where(cls: type[BaseSettings], name: str) -> str:
    """The variable that sets ``name`` (and its key in a settings file, if there is one)."""
    variable = f"{cls.model_config.get('env_prefix', '')}{name}".upper()
    return f"{variable} ({name})" if "config" in cls.model_fields else variable


def _example(cls: type[BaseSettings], name: str) -> str:
    field = cls.model_fields.get(name)
    if field is None or not field.examples:
        return ""
    return f"; e.g. {_where(cls, name).split()[0]}='{field.examples[0]}'"
