"""The served OpenAPI document, made to say what the gateway really answers.

FastAPI documents a 422 that never happens (validation errors are 400 here) and only JSON
bodies. This rewrites each operation's responses: the error statuses it can give, each in
OpenAI's error shape; ``text/event-stream`` for streams, NDJSON and CSV for exports, PEM for
the public key; ``Retry-After`` on 429.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error shape; `param` names the parameter).",
    401: "Missing or unknown API key.",
    403: "The key's role may not use this endpoint.",
    404: "Unknown model, key, team or audit event.",
    408: "The request body did not arrive in time.",
    409: (
        "A key or team with this name exists, a replay is refused (content erased or never "
        "stored), or a tamper alarm is not cleared (none stands, or the history is still short)."
    ),
    413: "The request body is over the size limit.",
    429: (
        "The request queue is full, or a quota's limit is reached (`rate_limit_exceeded`, "
        "`insufficient_quota`); retry after `Retry-After` seconds."
    ),
    503: "The audit store or the engine is unavailable, or the gateway is shutting down.",
}
_AUTHENTICATED = (400, 401, 403, 503)
# Unauthenticated paths (gateway/routes/health.py): only /readyz has an error status.
_PROBES = ("/healthz", "/livez", "/health", "/version", "/readyz")
_BODY = (408, 413)
# Statuses beyond the authenticated set, per (method, path).
_EXTRA: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (404, 429, *_BODY),
    ("post", "/v1/completions"): (404, 429, *_BODY),
    ("post", "/v1/responses"): (404, 429, *_BODY),
    ("get", "/v1/models/{model}"): (404,),
    ("post", "/tokenize"): (404, *_BODY),
    ("post", "/detokenize"): (404, *_BODY),
    ("post", "/v1/admin/keys"): (409, *_BODY),
    ("patch", "/v1/admin/keys/{key}"): (404, *_BODY),
    ("delete", "/v1/admin/keys/{key}"): (404,),
    ("get", "/v1/audit/proof/{event_id}"): (404,),
    ("post", "/v1/audit/replay/{event_id}"): (404, 409),
    ("post", "/v1/audit/cosignature"): _BODY,
    ("post", "/v1/admin/audit/alarm/clear"): (409, *_BODY),
    ("get", "/v1/admin/keys/{key}/quota"): (404,),
    ("put", "/v1/admin/keys/{key}/quota"): (404, *_BODY),
    ("put", "/v1/admin/keys/{key}/team"): (404, *_BODY),
    ("post", "/v1/admin/teams"): (409, *_BODY),
    ("get", "/v1/admin/teams/{team}/quota"): (404,),
    ("put", "/v1/admin/teams/{team}/quota"): (404, *_BODY),
}
_STRING = {"schema": {"type": "string"}}
_SUCCESS_CONTENT: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/v1/audit/export"): {"application/x-ndjson": _STRING, "text/csv": _STRING},
    ("get", "/v1/audit/public-key"): {"application/x-pem-file": _STRING},
    ("get", "/v1/audit/checkpoint"): {"text/plain": _STRING},
    ("get", "/v1/admin/usage"): {
        "application/json": {"schema": {"type": "object"}},
        "text/csv": _STRING,
    },
}
_STREAMS = {
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("post", "/v1/responses"),
}


def _error(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": _ERROR_REF}},
    }
    if status == 429:
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return response


def truthful_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    app.openapi_schema = None
    document = FastAPI.openapi(app)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            key = (method, path)
            if path in _PROBES:
                statuses: tuple[int, ...] = (503,) if path == "/readyz" else ()
            else:
                statuses = (*_AUTHENTICATED, *_EXTRA.get(key, ()))
            for status in sorted(set(statuses)):
                responses[str(status)] = _error(status)
            success = next(code for code in responses if code.startswith("2"))
            if key in _SUCCESS_CONTENT:
                responses[success]["content"] = _SUCCESS_CONTENT[key]
            if key in _STREAMS:
                responses[success]["content"]["text/event-stream"] = {
                    "schema": {"type": "string", "description": "Server-sent events."}
                }
    app.openapi_schema = document
    return document


def install(app: FastAPI) -> None:
    app.openapi = lambda: truthful_openapi(app)  # type: ignore[method-assign]
