"""Schemathesis against the served OpenAPI schema, one test per operation: generated requests
never get a 5xx; valid ones get answers that match the schema (status, content type, body)."""

from __future__ import annotations

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
CHECKS = {
    GenerationMode.POSITIVE: [not_a_server_error, status_code_conformance,
                              content_type_conformance, response_schema_conformance],
    GenerationMode.NEGATIVE: [not_a_server_error, content_type_conformance],
}


@pytest.fixture(scope="module")
def api_schema(admin_api: Any) -> Any:
    return schemathesis.openapi.from_url(f"{admin_api.url}/openapi.json")


@pytest.mark.parametrize("mode", list(CHECKS), ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_generated_requests_never_get_a_server_error(
    api_schema: Any, admin_api: Any, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    headers = {"Authorization": f"Bearer {admin_api.token}"}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20 if mode is GenerationMode.POSITIVE else 10, deadline=None,
              database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        case.call_and_validate(headers=headers, checks=CHECKS[mode])

    check()
