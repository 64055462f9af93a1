"""What the dashboard shows for a healthy server: the real binary serves calls that all succeed,
its /metrics scrape becomes a steady input of `promtool test rules`, and promtool evaluates the
panels' queries over it. The error panels must show 0 (not "No data", which reads as "broken"
and hides the first error from increase()), and the process panels must show data."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from conftest import DASHBOARD, run
from test_metric_names import (
    LABEL,
    SAMPLE,
    metric_name,
    selectors_and_groupings,
    serve_and_scrape,
)

# Panels that count failures: 0 on a healthy server.
ZERO_PANELS = [
    "Server-side errors",
    "Errors by method and code",
    "Allocation failures and reclaimed pages",
    "Internal (CUDA) errors and restarts",
]
# Panels that must have data on any running server.
DATA_PANELS = [
    "Calls / s",
    "Resident memory by server",
    "Open file descriptors by server",
    "CPU by server",
    "Uptime by server",
]
# The labels a Prometheus scrape adds (as the ServiceMonitor's target would).
TARGET = 'job="attnserve", namespace="ml", instance="attnserve-0"'
STEPS = 20  # one-minute samples of the scrape, constant: nothing happens during them
EVAL_TIME = "15m"
GRAFANA_VARS = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def input_series(text: str) -> list[dict]:
    """Every sample of the exposition as a constant series with the target labels."""
    series = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        value = float(line.rsplit(" ", 1)[1])
        if not math.isfinite(value):
            continue
        labels = [f'{n}="{v}"' for n, v in LABEL.findall(m.group(2) or "")]
        selector = f"{m.group(1)}{{{', '.join([TARGET, *labels])}}}"
        series.append({"series": selector, "values": f"{value:.6f}x{STEPS}"})
    return series


def to_promql(expr: str) -> str:
    """Grafana variables replaced: intervals by 5m, the rest (server, job, pool selections,
    always inside =~ matchers) by "everything"."""

    def value(m: re.Match) -> str:
        return "5m" if m.group(1).startswith("__") else ".+"

    return GRAFANA_VARS.sub(value, expr)


def panel_queries(titles: list[str]) -> list[tuple[str, str]]:
    """(panel and refId, PromQL) of the panels named, leaving out queries of series that come
    from elsewhere (kube-state-metrics' restarts), which this setup cannot have."""
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    out = []
    for title in titles:
        for target in panels[title]["targets"]:
            expr = to_promql(target["expr"])
            selectors, _ = selectors_and_groupings(promql_parser.parse(expr))
            if all(metric_name(s).startswith(("attn_", "process_")) for s in selectors):
                out.append((f"{title} {target['refId']}", expr))
    return out


@pytest.fixture(scope="module")
def healthy(api, tmp_path_factory) -> list[dict]:
    return input_series(serve_and_scrape(api, tmp_path_factory.mktemp("healthy"), failures=False))


def evaluate(promtool: str, series: list[dict], cases: list[dict], tmp: Path) -> str:
    """Runs the promql_expr_test cases over the series; promtool's complaints, "" when none."""
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}],
    }
    (tmp / "panels_test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    result = run([promtool, "test", "rules", "panels_test.yaml"], cwd=tmp)
    return "" if result.returncode == 0 else result.stdout + result.stderr


def test_error_panels_show_zero(promtool: str, healthy, tmp_path: Path) -> None:
    queries = panel_queries(ZERO_PANELS)
    assert len(queries) >= len(ZERO_PANELS)
    cases = []
    for _, expr in queries:
        # Some sample (absent() of it is empty) and none that is not 0 (NaN included).
        cases.append({"expr": f"absent({expr})", "eval_time": EVAL_TIME, "exp_samples": []})
        cases.append({"expr": f"({expr}) != 0", "eval_time": EVAL_TIME, "exp_samples": []})
    problems = evaluate(promtool, healthy, cases, tmp_path)
    assert not problems, f"{[w for w, _ in queries]}:\n{problems}"


def test_process_panels_have_data(promtool: str, healthy, tmp_path: Path) -> None:
    queries = panel_queries(DATA_PANELS)
    cases = [
        {"expr": f"absent({e})", "eval_time": EVAL_TIME, "exp_samples": []} for _, e in queries
    ]
    problems = evaluate(promtool, healthy, cases, tmp_path)
    assert not problems, f"{[w for w, _ in queries]}:\n{problems}"


def test_the_evaluation_catches_no_data(promtool: str, healthy, tmp_path: Path) -> None:
    """The check itself: a panel query as it was (a ratio with no error series) has no data."""
    before = (
        'sum(rate(attn_rpc_requests_total{code=~"internal|unknown"}[5m]))'
        " / sum(rate(attn_rpc_requests_total[5m]))"
    )
    cases = [{"expr": f"absent({before})", "eval_time": EVAL_TIME, "exp_samples": []}]
    assert "absent" in evaluate(promtool, healthy, cases, tmp_path)
