"""Schemathesis against the served OpenAPI schema of the admin API over the real service, one
test per operation and mode: generated requests never get a 5xx; valid ones get answers that
match the schema (status, content type, body); without the token, every answer is a documented
problem. Examples are derandomized (the same on every run) and bounded: at most
``len(OPERATIONS) * sum(EXAMPLES.values())`` requests, a few hundred."""

from __future__ import annotations

import enum
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from cmx.api.app import create_app
from cmx.config import AdminConfig

# The operations, from the app's own schema (building it needs no service).
OPERATIONS = [(method.upper(), path) for path, item in
              create_app(lambda: None, AdminConfig()).openapi()["paths"].items()  # type: ignore[arg-type,return-value]
              for method in item]


class Mode(enum.Enum):
    VALID = "valid"  # schema-conforming requests, with the token
    INVALID = "invalid"  # requests that break the schema, with the token
    ANONYMOUS = "anonymous"  # schema-conforming requests without the token


GENERATION = {Mode.VALID: GenerationMode.POSITIVE, Mode.INVALID: GenerationMode.NEGATIVE,
              Mode.ANONYMOUS: GenerationMode.POSITIVE}
EXAMPLES = {Mode.VALID: 15, Mode.INVALID: 8, Mode.ANONYMOUS: 4}
CHECKS = {
    Mode.VALID: [not_a_server_error, status_code_conformance, content_type_conformance,
                 response_schema_conformance],
    Mode.INVALID: [not_a_server_error, content_type_conformance],
    Mode.ANONYMOUS: [not_a_server_error, status_code_conformance, content_type_conformance,
                     response_schema_conformance],
}
OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/api/v1/tiers"), ("GET", "/api/v1/nodes"),
        ("GET", "/api/v1/nodes/{node}"), ("GET", "/api/v1/pool"), ("GET", "/api/v1/history"),
        ("GET", "/metrics")}  # figures summed over tenants; everything else needs the token


def test_the_bound_is_a_few_hundred_requests() -> None:
    assert len(OPERATIONS) * sum(EXAMPLES.values()) <= 400


@pytest.fixture(scope="module")
def api_schema(admin_api: Any) -> Any:
    return schemathesis.openapi.from_url(f"{admin_api.url}/openapi.json")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_generated_requests_never_get_a_server_error(
    api_schema: Any, admin_api: Any, method: str, path: str, mode: Mode
) -> None:
    operation = api_schema[path][method]
    anonymous = mode is Mode.ANONYMOUS
    headers = {} if anonymous else {"Authorization": f"Bearer {admin_api.token}"}

    @given(case=operation.as_strategy(generation_mode=GENERATION[mode]))
    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        response = case.call_and_validate(headers=headers, checks=CHECKS[mode])
        if anonymous and (method, path) not in OPEN:
            assert response.status_code == 401, response.text
            assert response.headers["content-type"] == ["application/problem+json"]

    check()
