"""vLLM's exceptions -> fairserve's engine errors (``replicas/engine/errors.py``).

vLLM is not imported: its exceptions are recognised by class name along their MRO, which
also spans versions that moved them (0.10 raised ``ValueError`` for a bad request; later
versions raise ``VLLMValidationError``, a ``VLLMClientError`` that is no ``ValueError``):

- ``EngineDeadError`` (vllm.v1.engine.exceptions) -> ``EngineDeadError``;
- ``VLLMClientError`` (``VLLMValidationError`` ...) or ``ValueError`` -> ``InvalidRequestError``,
  its ``param`` from the error's ``parameter`` where vLLM names one, else guessed from the
  message (see ``_PARAM_WORDS``);
- ``EngineGenerateError``, ``GenerationError``, ``RetryableRequestError`` and any other
  ``VLLMServerError`` (a request failed inside vLLM, the engine lives on) -> ``EngineError``.

Anything else is returned unchanged: a bug, raised as it is.
"""

from __future__ import annotations

from replicas.engine.errors import EngineDeadError, EngineError, InvalidRequestError

_DEAD = "EngineDeadError"
_CLIENT = "VLLMClientError"
_REQUEST_FAILED = frozenset({"EngineGenerateError", "GenerationError", "RetryableRequestError",
                             "VLLMServerError"})
# vLLM's parameter names that fairserve calls otherwise
_PARAM_NAMES = {
    "structured_outputs": "response_format",
    "guided_decoding": "response_format",
    "logprobs": "top_logprobs",
}
# words of vLLM's messages that name the field, for errors without a ``parameter``;
# the structured-output ones count only when the request has a structured output
_PARAM_WORDS = (("logit_bias", "logit_bias"), ("stop_token_ids", "stop_token_ids"),
                ("max_tokens", "max_tokens"), ("min_tokens", "min_tokens"))
_STRUCTURED_WORDS = ("schema", "grammar", "json", "structured", "guided", "regex", "xgrammar",
                     "guidance", "outlines")


def map_vllm_error(exc: BaseException, has_structured_output: bool = False) -> BaseException:
    """The fairserve error for ``exc`` (``exc`` itself when it is one, or not vLLM's)."""
    if isinstance(exc, EngineError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    if _DEAD in names:
        return EngineDeadError(f"the vLLM engine died: {_describe(exc)}")
    if _CLIENT in names or isinstance(exc, ValueError):
        message = str(exc) or type(exc).__name__
        return InvalidRequestError(message, _param(exc, message, has_structured_output))
    if names & _REQUEST_FAILED:
        return EngineError(f"vLLM failed the request: {_describe(exc)}")
    return exc


def _param(exc: BaseException, message: str, has_structured_output: bool) -> str | None:
    named = getattr(exc, "parameter", None)
    if isinstance(named, str) and named:
        return _PARAM_NAMES.get(named, named)
    lowered = message.lower()
    if has_structured_output and any(word in lowered for word in _STRUCTURED_WORDS):
        return "response_format"
    for word, param in _PARAM_WORDS:
        if word in lowered:
            return param
    return None


def _describe(exc: BaseException) -> str:
    """The error and, for vLLM's wrappers with an empty message, what caused it."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    cause = exc.__cause__
    return f"{text} (caused by {cause!r})" if cause is not None else text
