"""Errors the router answers with, in the OpenAI error shape.

`APIError` carries the HTTP status and the four OpenAI fields; `body()` is the JSON object
`{"error": {"message", "type", "param", "code"}}` that goes out, as a response body or as the
data of an SSE error event. The constructors name the common cases. Deciding which case
applies is left to the validation and the handlers.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad_param(param: str, message: str, code: str = "invalid_parameter") -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param or None,
                    code=code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist; this server serves '{served}'.",
                    param="model", code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="no_healthy_node")


def overloaded(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_exceeded", code="queue_full")


def unauthorized() -> APIError:
    return APIError(401, "Missing or invalid API key (Authorization: Bearer <key>).",
                    type="invalid_request_error", code="invalid_api_key")


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
