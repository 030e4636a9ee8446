"""The OpenAI/vLLM error envelope and the exception that carries it to the HTTP layer."""
from __future__ import annotations

import json
from http import HTTPStatus

from starlette.responses import Response

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    """A request that ends in an error response; raised anywhere before or inside a handler."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        # vLLM's envelope: code is the integer HTTP status, type a class-like name.
        kind = _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> Response:
        # ASCII-escaped: a message quoting the request can never fail to encode (a lone surrogate)
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
