"""The Grafana dashboard's structure: valid JSON, a datasource variable every panel and query
uses, server and pool variables, the panels deploy/README.md describes, sane layout. (Its
queries are checked against a live server in test_metric_names.py.)"""

from __future__ import annotations

import json

from conftest import DASHBOARD

D = json.loads(DASHBOARD.read_text())
VARIABLES = {v["name"]: v for v in D["templating"]["list"]}
PANELS = [p for p in D["panels"] if p["type"] != "row"]
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REQUIRED_PANELS = [
    "Calls by method and code",
    "Errors by method and code",
    "Call latency by method (p50, p90, p99)",
    "Queue wait, kernel time and launch stages by pool and op",
    "Calls per launch by pool and op",
    "Query tokens per launch by pool and op",
    "Pool usage by server and pool",
    "Transfer bytes by direction",
    "Internal (CUDA) errors and restarts",
    "Resident memory by server",
    "Open file descriptors by server",
    "CPU by server",
    "Uptime by server",
]


def test_identity() -> None:
    assert D["uid"] == "attnserve" and D["title"] == "attnserve"
    assert isinstance(D["schemaVersion"], int)


def test_datasource_and_instance_variables() -> None:
    assert VARIABLES["datasource"]["type"] == "datasource"
    assert VARIABLES["datasource"]["query"] == "prometheus"
    instance = VARIABLES["instance"]
    assert instance["type"] == "query" and instance["multi"] and instance["includeAll"]
    assert instance["datasource"] == DATASOURCE


def test_every_panel_and_query_uses_the_datasource_variable() -> None:
    for panel in PANELS:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_query_is_scoped_to_the_selected_servers() -> None:
    for panel in PANELS:
        for target in panel["targets"]:
            assert "$instance" in target["expr"], f"{panel['title']} {target['refId']}"


def test_required_panels_are_present() -> None:
    titles = [p["title"] for p in PANELS]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    missing = [t for t in REQUIRED_PANELS if t not in titles]
    assert not missing, missing


def test_panels_have_unique_ids_units_and_fit_the_grid() -> None:
    ids = [p["id"] for p in D["panels"]]
    assert len(ids) == len(set(ids))
    for p in D["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    for p in PANELS:
        assert p.get("description"), f"{p['title']}: describe what to look at"
        if p["type"] in ("timeseries", "stat"):
            assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
