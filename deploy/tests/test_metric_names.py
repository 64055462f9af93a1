"""Every PromQL expression of the Grafana dashboard and of the alert rules parses (promql-parser,
a port of Prometheus' own parser), and names only metrics and labels that a live server exports:
the real binary is started on loopback, driven through each RPC (including failures), and its
/metrics scraped. Renaming a metric or a label in server/metrics/metrics.cc breaks this test until
the dashboard and the alerts follow."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import grpc
import promql_parser
import pytest

from conftest import DASHBOARD, SERVER_BIN, SERVER_KUSTOMIZATIONS, only
from server_process import Server, free_port

# Labels Prometheus attaches to every scraped series (the ServiceMonitor's targets).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}
# Series that come from Prometheus or kube-state-metrics, not from attnserve, with their labels.
EXTERNAL = {
    "up": TARGET_LABELS,
    "kube_pod_status_ready": {"namespace", "pod", "condition", "uid"},
    "kube_pod_container_status_restarts_total": {"namespace", "pod", "container", "uid"},
}
# Label values a server cannot show on a CPU run (every status code can happen somewhere).
GRPC_CODES = {
    "ok",
    "cancelled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
}
CODE_LABELS = {"code", "reason"}
# Labels whose values must be ones the live server showed (pool names depend on the config).
ENUM_LABELS = {"method", "op", "state", "direction"}
VAR = "__grafana_variable__"
INTERVAL_VARS = re.compile(
    r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}"
)
OTHER_VARS = re.compile(r"\$\{[^}]+\}|\$[A-Za-z_]\w*|\[\[[^\]]+\]\]")
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$", re.S)

SERVER_CONFIG = """
pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 1 page_size: 16 num_qo_heads: 4
        num_kv_heads: 2 head_dim: 64 num_pages: 8 }
pools { name: "mla" kind: POOL_KIND_MLA num_layers: 1 page_size: 64 num_qo_heads: 16
        num_pages: 4 }
"""


# ---- the live server's exposition -------------------------------------------------------------


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> dict[str, dict[str, set[str]]]:
    """metric name (as scraped: a histogram's _bucket, _sum, _count) -> label -> values seen."""
    metrics: dict[str, dict[str, set[str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"unparsable exposition line {line!r}"
        labels = metrics.setdefault(m.group(1), defaultdict(set))
        for name, value in LABEL.findall(m.group(2) or ""):
            labels[name].add(value)
    return metrics


def bf16_zeros(api, *shape: int):
    return api.message("Tensor")(
        dtype=api.message("Tensor")
        .DESCRIPTOR.fields_by_name["dtype"]
        .enum_type.values_by_name["DTYPE_BF16"]
        .number,
        shape=shape,
        data=bytes(2 * math.prod(shape)),
    )


def drive(api, address: str, failures: bool = True) -> None:
    """One call of each RPC, so every family has samples: a prefill of 8 tokens and a decode of
    one more on pool gqa (4 query / 2 KV heads, head_dim 64, page 16); with `failures`, also a
    refused allocation (RESOURCE_EXHAUSTED) and an unknown pool (NOT_FOUND)."""
    with grpc.insecure_channel(address) as channel:
        api.call(channel, "GetServerInfo")
        session = api.call(channel, "OpenSession").session
        (page,) = api.call(
            channel, "AllocatePages", pool="gqa", num_pages=1, session=session
        ).page_ids
        table = {"kv_indptr": [0, 1], "kv_indices": [page], "session": session}
        api.call(
            channel,
            "Prefill",
            pool="gqa",
            layer=0,
            q=bf16_zeros(api, 8, 4, 64),
            k_new=bf16_zeros(api, 8, 2, 64),
            v_new=bf16_zeros(api, 8, 2, 64),
            qo_indptr=[0, 8],
            kv_last_page_len=[8],
            **table,
        )
        api.call(
            channel,
            "Decode",
            pool="gqa",
            layer=0,
            q=bf16_zeros(api, 1, 4, 64),
            k_new=bf16_zeros(api, 1, 2, 64),
            v_new=bf16_zeros(api, 1, 2, 64),
            kv_last_page_len=[9],
            **table,
        )
        refused = (
            ("gqa", 8, grpc.StatusCode.RESOURCE_EXHAUSTED),
            ("no-such-pool", 1, grpc.StatusCode.NOT_FOUND),
        )
        for pool, pages, code in refused if failures else ():
            with pytest.raises(grpc.RpcError) as failed:
                api.call(channel, "AllocatePages", pool=pool, num_pages=pages, session=session)
            assert failed.value.code() == code
        api.call(channel, "FreePages", pool="gqa", page_ids=[page], session=session)


def serve_and_scrape(api, tmp: Path, failures: bool = True) -> str:
    """The /metrics text of a real server (SERVER_CONFIG, CPU backend, loopback) after drive()."""
    (tmp / "server.textproto").write_text(SERVER_CONFIG)
    metrics_port = free_port()
    server = Server(
        SERVER_BIN,
        [
            f"--config={tmp / 'server.textproto'}",
            "--listen_address=127.0.0.1:0",
            f"--metrics_port={metrics_port}",
            "--backend=cpu",
            "--cpu_threads=1",
        ],
        tmp / "server.log",
    ).start()
    try:
        drive(api, server.address, failures)
        text = server.scrape(metrics_port)
    finally:
        code = server.stop()
    assert code == 0, server.log()
    return text


@pytest.fixture(scope="module")
def exported(api, tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    return parse_exposition(serve_and_scrape(api, tmp_path_factory.mktemp("metrics-server")))


# ---- the expressions --------------------------------------------------------------------------


def grafana_to_promql(expr: str) -> str:
    """Grafana variables replaced: intervals by a duration, the rest by a placeholder string
    (they only ever stand inside a label matcher's quotes)."""
    return OTHER_VARS.sub(VAR, INTERVAL_VARS.sub("5m", expr))


def dashboard_queries() -> list[tuple[str, str, str | None]]:
    """(where, PromQL, label asked for by label_values or None) for every query."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"], None))
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = LABEL_VALUES.match(query.strip())
        assert m and m.group(1), f"variable {var['name']}: use label_values(<selector>, <label>)"
        out.append((f"variable {var['name']}", m.group(1), m.group(2)))
    return out


def rule_queries(objects: list[dict]) -> list[tuple[str, str, str | None]]:
    rule = only(objects, "PrometheusRule")
    return [
        (f"rule {r.get('alert') or r.get('record')}", r["expr"], None)
        for g in rule["spec"]["groups"]
        for r in g["rules"]
    ]


def all_queries(rendered) -> list[tuple[str, str, str | None]]:
    return dashboard_queries() + rule_queries(rendered(SERVER_KUSTOMIZATIONS[0]))


def selectors_and_groupings(ast) -> tuple[list, set[str]]:
    """The vector selectors of an expression and every label it groups or matches on."""
    selectors, grouping = [], set()

    def visit(node, *_):
        if isinstance(node, promql_parser.VectorSelector):
            selectors.append(node)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels or [])
        return True

    promql_parser.walk(ast, visit)
    return selectors, grouping


def metric_name(selector) -> str:
    if selector.name:
        return selector.name
    names = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    assert len(names) == 1 and re.fullmatch(r"\w+", names[0]), f"select metrics by name: {selector}"
    return names[0]


def regex_alternatives(value: str) -> list[str] | None:
    """'a|b|c' -> [a, b, c]; None when the regex is more than a plain alternation."""
    return value.split("|") if re.fullmatch(r"[\w|]+", value) else None


def check(expr: str, asked_label: str | None, exported: dict) -> list[str]:
    """What is wrong with one expression: unknown metrics, labels, label values."""
    try:
        ast = promql_parser.parse(grafana_to_promql(expr))
    except Exception as e:  # the parser raises ValueError-like errors
        return [f"does not parse: {e}"]
    problems = []
    selectors, grouping = selectors_and_groupings(ast)
    known_labels = set(TARGET_LABELS)
    for selector in selectors:
        name = metric_name(selector)
        if name in EXTERNAL:
            labels = {n: set() for n in EXTERNAL[name]}
        elif name in exported:
            labels = exported[name]
        else:
            problems.append(f"metric {name} is not exported by the server")
            continue
        known_labels |= set(labels)
        for m in selector.matchers.matchers:
            if m.name == "__name__":
                continue
            if m.name not in labels and m.name not in TARGET_LABELS:
                problems.append(f"{name} has no label {m.name}")
                continue
            if VAR in m.value or m.name not in ENUM_LABELS | CODE_LABELS or name in EXTERNAL:
                continue
            allowed = GRPC_CODES if m.name in CODE_LABELS else labels[m.name]
            if str(m.op) in ("MatchOp.Equal", "MatchOp.NotEqual"):
                values = [m.value]
            else:
                values = regex_alternatives(m.value) or []
            for v in values:
                if v not in allowed:
                    problems.append(f'{name}{{{m.name}="{v}"}}: the server uses {sorted(allowed)}')
    for label in grouping | ({asked_label} if asked_label else set()):
        if label not in known_labels:
            problems.append(f"groups or matches on {label!r}, which none of its metrics has")
    return problems


# ---- tests ------------------------------------------------------------------------------------


def test_server_exports_the_expected_families(exported) -> None:
    """Sanity check of the driving: the counters that need a failure have samples."""
    for name in (
        "attn_rpc_requests_total",
        "attn_request_errors_total",
        "attn_page_alloc_failures_total",
        "attn_rpc_duration_seconds_bucket",
        "attn_kernel_duration_seconds_bucket",
        "attn_launch_stage_seconds_bucket",
        "attn_kv_pages",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_cpu_seconds_total",
    ):
        assert name in exported, f"{name} missing from the scrape"
    assert {"Prefill", "Decode", "AllocatePages"} <= exported["attn_rpc_requests_total"]["method"]


def test_queries_parse_and_name_exported_metrics(rendered, exported) -> None:
    problems = []
    for where, expr, asked in all_queries(rendered):
        problems += [f"{where}: {p}" for p in check(expr, asked, exported)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "expr, complaint",
    [
        ('rate(attn_rpc_request_total{job="attnserve"}[5m])', "not exported"),
        ('attn_kv_pages{pool_name="x"}', "no label pool_name"),
        ('attn_kv_pages{state="allocated"}', 'state="allocated"'),
        ('attn_rpc_requests_total{code="Internal"}', 'code="Internal"'),
        ("sum by (gpu) (attn_inflight_requests)", "'gpu'"),
        ("rate(attn_rpc_requests_total[5m]", "does not parse"),
    ],
)
def test_the_check_catches_mistakes(exported, expr: str, complaint: str) -> None:
    problems = check(expr, None, exported)
    assert any(complaint in p for p in problems), problems


# Exported for completeness (the standard process families) but not drawn: with the CUDA
# backend the address space maps the device's memory, so its size tells nothing.
NOT_ON_THE_DASHBOARD = {"process_virtual_memory_bytes"}


def test_dashboard_covers_every_exported_family(exported) -> None:
    """A new server metric gets a panel (histograms count by their base name)."""
    used = " ".join(expr for _, expr, _ in dashboard_queries())
    families = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for n in exported
        if n.startswith(("attn_", "process_")) and n not in NOT_ON_THE_DASHBOARD
    }
    missing = sorted(f for f in families if not re.search(rf"\b{f}(_bucket|_sum|_count)?\b", used))
    assert not missing, f"not on the dashboard: {missing}"


def test_bytes_per_page_formula_matches_the_server(api, tmp_path: Path) -> None:
    """The pool sizing arithmetic (test_manifests.bytes_per_page, deploy/README.md) is the
    server's: GetServerInfo reports the same bytes per page for a GQA and an MLA pool."""
    from test_manifests import bytes_per_page

    (tmp_path / "server.textproto").write_text(SERVER_CONFIG)
    server = Server(
        SERVER_BIN,
        [
            f"--config={tmp_path / 'server.textproto'}",
            "--listen_address=127.0.0.1:0",
            "--metrics_port=0",
            "--backend=cpu",
            "--cpu_threads=1",
        ],
        tmp_path / "log",
    ).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            pools = api.call(channel, "GetServerInfo").pools
        assert len(pools) == 2
        for pool in pools:
            assert pool.bytes_per_page == bytes_per_page(pool), pool.name
    finally:
        assert server.stop() == 0
