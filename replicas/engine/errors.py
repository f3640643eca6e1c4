"""Errors raised by the engine.

The router maps these onto OpenAI error bodies in one place; the engine only says what went
wrong and, for bad input, which field.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request or sampling parameter is invalid; nothing was scheduled.

    ``param`` names the offending field (OpenAI's error body has a ``param`` member).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(EngineError):
    """A model file or directory is missing, unreadable or not a supported model."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message}: {path}")
        self.path = path


class EngineDeadError(EngineError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""
