"""Alert rules: the PrometheusRule's groups pass `promtool check rules` (syntax, PromQL,
templates, strict fields) and the unit tests in alerts_test.yaml (`promtool test rules`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from conftest import SERVER_KUSTOMIZATIONS, kid, only, run

TESTS = Path(__file__).resolve().parent
UNIT_TESTS = TESTS / "alerts_test.yaml"
RULES_NAME = "attnserve.rules.yaml"  # the name alerts_test.yaml loads


def write_rules(objects: list[dict], directory: Path) -> Path:
    """The PrometheusRule's spec as a plain Prometheus rules file."""
    rule = only(objects, "PrometheusRule")
    path = directory / RULES_NAME
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "directory", SERVER_KUSTOMIZATIONS, ids=[kid(k) for k in SERVER_KUSTOMIZATIONS]
)
def test_promtool_check_rules(rendered, promtool: str, directory: Path, tmp_path: Path) -> None:
    rules = write_rules(rendered(directory), tmp_path)
    result = run([promtool, "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    "directory", SERVER_KUSTOMIZATIONS, ids=[kid(k) for k in SERVER_KUSTOMIZATIONS]
)
def test_promtool_test_rules(rendered, promtool: str, directory: Path, tmp_path: Path) -> None:
    write_rules(rendered(directory), tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = run([promtool, "test", "rules", UNIT_TESTS.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test(rendered) -> None:
    rule = only(rendered(SERVER_KUSTOMIZATIONS[0]), "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"]}
    fired = {
        case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]
    }
    assert alerts == tested, f"untested: {alerts - tested}, unknown: {tested - alerts}"
    assert alerts == fired, f"never seen firing in a test: {alerts - fired}"


def test_every_alert_has_severity_and_text(rendered) -> None:
    rule = only(rendered(SERVER_KUSTOMIZATIONS[0]), "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            if "alert" in r:
                assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
                assert r["annotations"].get("summary") and r["annotations"].get("description")
