"""``POST /v1/reports`` is answered by a plain ASGI endpoint in front of FastAPI's routing
(``CollectorApp``); FastAPI's route stays as the reference and in ``/openapi.json``. Two
real collectors with the same settings, one answering through the endpoint and one with
every request routed by FastAPI, get the same requests: every answer (status, headers,
body bytes) and the outcome counters must be the same. Also the decoder's shared labels:
one object per spelling, read-only, and never a cached verdict for another spelling."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.monitor.helpers import body, report
from trainvitals.monitor.app import CollectorApp, create_app
from trainvitals.monitor.decode import BodyInvalid, decode_batch
from trainvitals.monitor.series import Labels
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings

TOKEN = "s3cret-ingest-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json", **AUTH}


class _Routed:
    """The collector app with every request routed by FastAPI (the reference)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await FastAPI.__call__(self.app, scope, receive, send)


@contextmanager
def _collectors() -> Iterator[tuple[httpx.Client, httpx.Client]]:
    def settings() -> Settings:
        return Settings(state_path=None, token=TOKEN, max_series=40, max_body_bytes=4096, max_decompressed_bytes=8192)

    fast, routed = create_app(settings()), create_app(settings())
    assert isinstance(fast, CollectorApp)
    with (
        serve_in_thread(fast, settings=fast.state.settings) as fast_url,
        serve_in_thread(_Routed(routed), settings=routed.state.settings) as routed_url,
        httpx.Client(base_url=fast_url, timeout=10) as a,
        httpx.Client(base_url=routed_url, timeout=10) as b,
    ):
        yield a, b


def _answer(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    base = str(response.request.url.copy_with(path="/", query=None))  # a redirect names its server
    headers = [(k, v.replace(base, "/")) for k, v in response.headers.multi_items() if k not in ("date", "server")]
    return response.status_code, headers, response.content


_GOOD = [{"name": "loss", "labels": {"modality": "text"}, "value": 2.5}, {"name": "grad_norm", "value": 1.0}]

# (what, method, headers, content): sent in this order to both collectors.
CASES: list[tuple[str, str, dict[str, str], bytes]] = [
    ("accepted", "POST", JSON, body(report("r1", 1, _GOOD, sender="s1", seq=1))),
    ("a retry: duplicate", "POST", JSON, body(report("r1", 1, _GOOD, sender="s1", seq=1))),
    (
        "labels spelled otherwise",
        "POST",
        JSON,
        body(report("r1", 2, [{"name": "loss", "labels": {"modality": "text"}, "value": 3}])),
    ),
    ("NaN token: reference decode", "POST", JSON, body(report("r1", 3, [{"name": "loss", "value": float("nan")}]))),
    ("no token", "POST", {"Content-Type": "application/json"}, body(report())),
    ("wrong token", "POST", {"Content-Type": "application/json", "Authorization": "Bearer nope"}, body(report())),
    ("not JSON content type", "POST", {**AUTH, "Content-Type": "text/plain"}, body(report())),
    ("unknown encoding", "POST", {**JSON, "Content-Encoding": "br"}, body(report())),
    ("not JSON", "POST", JSON, b"{nope"),
    ("too large", "POST", JSON, body(report(samples=[{"name": "loss", "value": float(i)} for i in range(200)]))),
    ("bad gzip", "POST", {**JSON, "Content-Encoding": "gzip"}, b"\x1f\x8bnot gzip"),
    ("gzip bomb", "POST", {**JSON, "Content-Encoding": "gzip"}, gzip.compress(b" " * 100_000)),
    ("gzip, accepted", "POST", {**JSON, "Content-Encoding": "gzip"}, gzip.compress(body(report("r1", 4, _GOOD)))),
    ("bad step", "POST", JSON, body(report(step=-1))),
    ("labels not an object", "POST", JSON, body(report(samples=[{"name": "loss", "labels": 5, "value": 1.0}]))),
    (
        "label value not a string",
        "POST",
        JSON,
        body(report(samples=[{"name": "loss", "labels": {"modality": 1}, "value": 1.0}])),
    ),
    (
        "empty label value",
        "POST",
        JSON,
        body(report(samples=[{"name": "loss", "labels": {"modality": ""}, "value": 1.0}])),
    ),
    ("reserved label", "POST", JSON, body(report(samples=[{"name": "loss", "labels": {"run": "x"}, "value": 1.0}]))),
    ("bad name", "POST", JSON, body(report(samples=[{"name": "Loss!", "value": 1.0}]))),
    ("unknown field", "POST", JSON, body(report(samples=[{"name": "loss", "value": 1.0, "unit": "x"}]))),
    ("name clash", "POST", JSON, body(report(samples=[{"name": "grad_norm_total", "value": 1.0}]))),
    (
        "full: 503 Retry-After",
        "POST",
        JSON,
        body(
            *[
                report(
                    f"big{i}", 1, [{"name": "loss", "labels": {"modality": f"m{j}"}, "value": 1.0} for j in range(9)]
                )
                for i in range(4)
            ]
        ),
    ),
    ("another method", "GET", AUTH, b""),
    ("a trailing slash", "POST", JSON, body(report())),
]


def test_every_answer_is_the_routes_byte_for_byte():
    with _collectors() as (fast, routed):
        for what, method, headers, content in CASES:
            path = "/v1/reports/" if what == "a trailing slash" else "/v1/reports"
            a = fast.request(method, path, headers=headers, content=content)
            b = routed.request(method, path, headers=headers, content=content)
            assert _answer(a) == _answer(b), what
        counted = [
            [
                line
                for line in c.get("/metrics").text.splitlines()
                if line.startswith("trainvitals_collector_reports_total")
            ]
            for c in (fast, routed)
        ]
        assert counted[0] == counted[1]
        outcomes = {line.split('outcome="')[1].split('"')[0] for line in counted[0]}
        assert {"accepted", "duplicate", "unauthorized", "unsupported_media", "invalid", "too_large"} <= outcomes
        assert {"bad_gzip", "series_limit"} <= outcomes


def test_the_route_is_still_documented():
    app = create_app(Settings(state_path=None))
    post = app.openapi()["paths"]["/v1/reports"]["post"]
    assert "202" in post["responses"] and "requestBody" in post


def _labels_of(raw: bytes) -> list[Any]:
    return [s.labels for r in decode_batch(raw).reports for s in r.samples]


def test_labels_spelled_alike_are_one_read_only_object_with_the_stores_key():
    samples = [{"name": "param_absmax", "labels": {"param": "w", "group": "a"}, "value": float(i)} for i in range(3)]
    first, second = _labels_of(body(report(samples=samples))), _labels_of(body(report(step=2, samples=samples)))
    assert all(lab is first[0] for lab in first + second)
    assert isinstance(first[0], Labels) and first[0] == {"param": "w", "group": "a"}
    assert first[0].key == (("group", "a"), ("param", "w"))
    with pytest.raises(TypeError, match="copy them"):
        first[0]["param"] = "v"
    assert dict(first[0]) == {"param": "w", "group": "a"}
    # Spelled otherwise (another order, spaces): another object, the same labels and key.
    spelled = b'{"name": "param_absmax", "labels": {"group" : "a", "param":"w"}, "value": 1}'
    other = _labels_of(b'{"schema": 1, "reports": [{"run": "r1", "step": 3, "time": 1.0, "samples": [%s]}]}' % spelled)[
        0
    ]
    assert other == first[0] and other.key == first[0].key
    assert _labels_of(body(report(samples=[{"name": "loss", "value": 1.0}])))[0] == {}


def test_a_known_spelling_never_vouches_for_a_bad_one():
    good = [{"name": "loss", "labels": {"modality": "text"}, "value": 1.0}]
    decode_batch(body(report(samples=good)))
    bad = [*good, {"name": "loss", "labels": {"modality": "te\u0007xt"}, "value": 1.0}]
    with pytest.raises(BodyInvalid, match=r"reports\.0\.samples\.1\.labels.*non-printable"):
        decode_batch(body(report(samples=bad)))
    with pytest.raises(BodyInvalid, match=r"reports\.0\.samples\.1\.name"):
        decode_batch(body(report(samples=[*good, {"name": "loss_ms", "value": 1.0}])))
    # A body that failed leaves nothing remembered: the same bad spelling is refused again.
    with pytest.raises(BodyInvalid, match="non-printable"):
        decode_batch(body(report(samples=bad[1:])))
