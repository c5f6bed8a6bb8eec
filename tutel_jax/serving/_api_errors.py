"""The server's errors, in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from ._sampling import NonFiniteLogitsError

__all__ = ["APIError", "bad_request", "error_body", "generation_error"]


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON body of an OpenAI-style error."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with HTTP `status` and an OpenAI-style body (`param`: the request field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 `invalid_request_error` naming the request field `param`."""
    return APIError(400, message, param, code)


def generation_error(e: Exception) -> APIError:
    """The 500 a client gets for a failed generation (NaN / inf logits get their own code)."""
    code = "non_finite_logits" if isinstance(e, NonFiniteLogitsError) else "internal_error"
    return APIError(500, f"generation failed: {e}", code=code, type="server_error")
