"""A small client of the admin API for the command line (the standard library's urllib)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from cmx.errors import CmxError

__all__ = ["AdminApiError", "AdminClient"]


class AdminApiError(CmxError):
    """The admin API answered with an error, or did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def get(self, path: str) -> Any:
        return self._request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self._request("POST", path, body)

    def delete(self, path: str) -> Any:
        return self._request("DELETE", path)

    def healthy(self) -> bool:
        try:
            self.get("/healthz")
            return True
        except AdminApiError:
            return False

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminApiError(_problem_text(exc), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminApiError(f"the admin API at {self.url} did not answer: {reason}") from None
        return json.loads(payload) if payload else None


def _problem_text(exc: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(exc.read())
        detail = doc.get("detail") or doc.get("title")
    except (ValueError, AttributeError, OSError):
        detail = exc.reason
    return f"{exc.code}: {detail}"
