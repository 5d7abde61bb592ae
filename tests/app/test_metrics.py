"""/metrics: what a Grafana user expects (units in names, histograms, build info)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from contract import __version__


def test_names_follow_prometheus_conventions(client: TestClient) -> None:
    client.post("/negotiate", json={"required_alignment": 96})
    text = client.get("/metrics").text
    assert "_created" not in text
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("mpcache_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if "bytes" in family.name:
            assert family.name.endswith("_bytes"), family.name
    assert "# TYPE mpcache_copied_bytes_total counter" in text


def test_build_info(client: TestClient) -> None:
    text = client.get("/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("mpcache_build_info{")]
    assert f'version="{__version__}"' in line and 'torch="' in line
    assert line.endswith(" 1.0")


def test_request_and_cache_op_histograms(client: TestClient) -> None:
    client.post("/negotiate", json={"required_alignment": 96})
    client.post(
        "/cache/lookup",
        json={"requests": [{"request_id": "r", "namespace": "n", "tokens": list(range(300))}]},
    )
    client.delete("/register/some%2Finstance/3")
    client.get("/no/such/path")
    text = client.get("/metrics").text
    assert 'mpcache_cache_op_duration_seconds_count{op="lookup"} 1.0' in text
    assert (
        'mpcache_http_request_duration_seconds_count{method="POST",route="/negotiate",'
        'status="200"} 1.0'
    ) in text
    # Route templates, never raw paths: the label set stays bounded.
    assert 'route="/register/{instance_id:path}/{rank}",status="404"' in text
    assert 'route="other",status="404"' in text
    assert "some%2Finstance" not in text and "/no/such/path" not in text


def test_gauges_are_read_at_scrape_time(client: TestClient) -> None:
    client.post("/negotiate", json={"required_alignment": 96})
    client.post(
        "/cache/lookup",
        json={"requests": [{"request_id": "r", "namespace": "n", "tokens": list(range(300))}]},
    )
    text = client.get("/metrics").text
    assert "mpcache_sessions 1.0" in text
    assert "mpcache_pool_capacity_bytes 4.194304e+06" in text
    assert "mpcache_copy_threads 2.0" in text  # MPCACHE_COPY_THREADS, tests/conftest.py


def test_openmetrics_when_asked(client: TestClient) -> None:
    reply = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert reply.headers["content-type"].startswith("application/openmetrics-text")
    assert reply.text.endswith("# EOF\n")
