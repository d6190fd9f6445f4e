"""ops/: the Grafana dashboard and the Prometheus alert rules agree with the metrics the library exports.

The truth is what ``celery_outbox.ops.metrics`` really serves: a database holding a row of every kind is
scraped once and parsed, so a renamed metric or label, a counter's ``_total`` suffix, or a new metric
without a panel fails here. PromQL syntax and the alerts' behaviour are checked by ``promtool`` (Debian
package ``prometheus``): locally a missing promtool skips those tests with the reason; under CI=true it
fails them (.ci/run installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters, migrate
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops import partitions
from celery_outbox.ops.metrics import OutboxCollector, QueueDepth, make_registry, render
from celery_outbox.schema import Tables
from celery_outbox.testing import ManualClock
from tests.conftest import scratch_database
from tests.ops_seed import T0, consumer_dead_letter, counter, inbox_rows, outbox_row
from tests.services import IN_CI

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "outbox-dashboard.json"
RULES = ROOT / "ops" / "prometheus" / "outbox-alerts.yml"
RULE_TESTS = ROOT / "ops" / "prometheus" / "outbox-alerts.test.yml"

PARTITION_FAMILIES = ("outbox_partition_headroom_rows", "outbox_partitions_ahead")
TARGET_LABELS = frozenset({"instance", "job"})  # Prometheus adds these to every scraped series
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
PROMQL_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                             "and", "or", "unless", "inf", "nan", "atan2"})


# --- what the library exports -------------------------------------------------------------------------


def exported_metrics(sessions: sessionmaker[Session], tables: Tables, *,
                     partitioned: bool = False) -> dict[str, frozenset[str]]:
    """Sample name -> label names, from one scrape of a database holding a row of every kind."""
    with sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=T0)  # pending
        held = outbox_row(s, tables=tables, created_at_ms=T0, type="shop.charge")  # held for a worker (deploy)
        held.held_for = "waiting for a worker that runs shop.charge on queue shop"
        s.commit()
        outbox_row(s, tables=tables, created_at_ms=T0, dead_lettered_at_ms=T0 + 1, attempts=10, last_error="no")
        outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 1)
        consumer_dead_letter(s, tables=tables, consumer="billing")
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=2)
        for name in (counters.PUBLISHED, counters.PUBLISH_FAILURES, counters.BROKER_UNAVAILABLE, counters.DEAD_LETTERED):
            counter(s, tables=tables, consumer=counters.RELAY, name=name, value=1)
        for name in (counters.DUPLICATES, counters.INBOX_PRUNED, counters.DEAD_LETTERED, counters.BATCHES,
                     counters.BATCHED_MESSAGES):
            counter(s, tables=tables, consumer="shipping", name=name, value=1)
    clock = ManualClock(start_ms=T0 + 60_000)

    def queue_probe() -> list[QueueDepth]:  # what a RabbitMQ broker reports (Redis leaves out the consumer count)
        return [QueueDepth(queue="t.shipping", consumer="shipping", messages=3, consumers=0)]
    text = render(make_registry(tables=tables, session_factory=sessions, clock=clock, queue_probe=queue_probe)).decode()
    exported: dict[str, set[str]] = {}
    families = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            families.add(family.name)
            exported.setdefault(sample.name, set()).update(sample.labels)
    described = {m.name for m in OutboxCollector(tables=tables, session_factory=sessions, clock=clock,
                                                 queue_probe=queue_probe).describe()}
    if sessions.kw["bind"].dialect.name != "postgresql":  # the vacuum families are Postgres-only
        described = {n for n in described if not n.startswith(("outbox_db_", "outbox_table_"))}
    if not partitioned:  # the partition families only on the partitioned layout (docs/partitioning.md)
        described = {n for n in described if not n.startswith(PARTITION_FAMILIES)}
    assert described <= families, f"the seed left families without a sample: {sorted(described - families)}"
    return {name: frozenset(labels) for name, labels in exported.items()}


def partitioned_metrics(tables: Tables) -> dict[str, frozenset[str]]:
    """One scrape of a database of its own whose outbox table is partitioned (docs/partitioning.md)."""
    with scratch_database("outbox_dash") as url:
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            sessions = make_session_factory(engine)
            partitions.convert(sessions, tables=tables, size=1000, ahead=2)
            return exported_metrics(sessions, tables, partitioned=True)
        finally:
            engine.dispose()


@pytest.fixture
def exported(sqlite_sessions: sessionmaker[Session], pg_sessions: sessionmaker[Session],
             tables: Tables) -> dict[str, frozenset[str]]:
    """SQLite's scrape, Postgres's and a partitioned outbox's: the vacuum metrics are Postgres-only (absent on
    SQLite, not zero), the partition metrics only on the partitioned layout."""
    lite, pg = exported_metrics(sqlite_sessions, tables), exported_metrics(pg_sessions, tables)
    assert set(lite) <= set(pg) and not any(name.startswith(("outbox_db_", "outbox_table_")) for name in lite)
    assert not any(name.startswith(PARTITION_FAMILIES) for name in pg)
    part = partitioned_metrics(tables)
    assert set(pg) <= set(part)
    return {name: part[name] | pg.get(name, frozenset()) | lite.get(name, frozenset()) for name in part}


# --- PromQL, read just enough to name what it selects -------------------------------------------------


@dataclass(frozen=True)
class Query:
    metrics: frozenset[str]
    matcher_labels: dict[str, frozenset[str]]  # metric ("" for a name-less selector) -> labels it matches on
    grouping_labels: frozenset[str]  # by (...) / without (...) / on (...) / ignoring (...)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def parse_promql(expr: str) -> Query:
    """Metric names, matcher labels and grouping labels of a PromQL expression (no Grafana variables left)."""
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    grouping: set[str] = set()
    text = _RANGE.sub(" ", expr)
    # Matchers first (their values are strings; blank them so a value never reads as a name).
    matchers: dict[str, set[str]] = {}
    def name(m: re.Match[str]) -> str:  # "or {...}": a keyword before a name-less selector is no name
        return "" if (m.group(1) or "").lower() in PROMQL_KEYWORDS else m.group(1) or ""
    for m in _SELECTOR.finditer(_STRING.sub('""', text)):
        matchers.setdefault(name(m), set()).update(_MATCHER.findall(m.group(2)))
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", _STRING.sub('""', text))
    for m in _GROUPING.finditer(text):
        grouping.update(label.strip() for label in m.group(2).split(",") if label.strip())
    text = _GROUPING.sub(" ", text)
    metrics = {name for name, call in _IDENT.findall(text) if not call and name.lower() not in PROMQL_KEYWORDS}
    return Query(frozenset(metrics), {k: frozenset(v) for k, v in matchers.items()}, frozenset(grouping))


def test_the_promql_reader_finds_names_labels_and_groupings() -> None:
    # Given an expression with a range, a subquery, a matcher on a name-less selector, string values and groupings
    q = parse_promql('sum by (consumer) (rate(outbox_x_total{consumer=~"a|b", kind!="or"}[5m])) '
                     '/ on (consumer) group_left max_over_time(outbox_y[10m:1m]) > bool 0 '
                     'or {__name__="outbox_z", source="s"} unless absent(outbox_w offset 5m)')
    # Then it names every metric, the labels each matches on and the grouping labels, and nothing else
    assert q.metrics == {"outbox_x_total", "outbox_y", "outbox_w"}
    assert q.matcher_labels == {"outbox_x_total": {"consumer", "kind"}, "": {"__name__", "source"}}
    assert q.grouping_labels == {"consumer"}


def check_query(expr: str, exported: dict[str, frozenset[str]], where: str) -> Query:
    q = parse_promql(expr)
    assert q.metrics, f"{where}: selects no metric: {expr}"
    unknown = q.metrics - set(exported)
    assert not unknown, f"{where}: {sorted(unknown)} is not exported by celery_outbox/ops/metrics.py: {expr}"
    assert "" not in q.matcher_labels, f"{where}: a selector without a metric name: {expr}"
    for metric, labels in q.matcher_labels.items():
        bad = labels - exported[metric] - TARGET_LABELS
        assert not bad, f"{where}: {metric} has no label {sorted(bad)}: {expr}"
    available = set().union(*(exported[m] for m in q.metrics)) | TARGET_LABELS
    assert q.grouping_labels <= available, f"{where}: groups by unknown label(s) " \
                                           f"{sorted(q.grouping_labels - available)}: {expr}"
    return q


# --- promtool ------------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def run_promtool(*args: str, cwd: Path) -> str:
    r = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"promtool {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


# --- the dashboard ------------------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash.get("templating", {}).get("list", [])}


def substitute(expr: str, names: set[str], where: str) -> str:
    """Grafana variables -> values Prometheus accepts; an undefined variable fails."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in names, f"{where}: ${name} is not a dashboard variable"
        return ".*"
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def targets(dash: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(where, target, PromQL with variables substituted) for every query of every panel."""
    names = set(variables(dash))
    for p in panels(dash):
        for t in p.get("targets", []):
            where = f"panel {p['id']} {p['title']!r} target {t.get('refId')}"
            yield where, t, substitute(t["expr"], names, where)


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    dash = load_dashboard()
    # Then it has what Grafana's import needs and a stable uid
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("templating", dict)):
        assert isinstance(dash.get(key), kind), f"dashboard.{key} must be a {kind.__name__}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    # And the Prometheus data source is a variable every panel and query uses
    vs = variables(dash)
    assert vs["datasource"]["type"] == "datasource" and vs["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], int] = {}
    for p in panels(dash):
        assert isinstance(p.get("title"), str) and p["title"], f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, f"panel {p['id']}: {g}"
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels on one grid cell
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap"
                cells[(x, y)] = p["id"]
        if p["type"] == "row":
            continue
        assert p["type"] in {"stat", "timeseries", "gauge", "table", "bargauge"}, p["type"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, f"panel {p['id']}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), f"panel {p['id']}: targets need unique refIds"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and isinstance(t["expr"], str) and t["expr"].strip()


def test_every_panel_query_selects_exported_metrics_and_labels(exported: dict[str, frozenset[str]]) -> None:
    dash = load_dashboard()
    used: set[str] = set()
    for where, target, expr in targets(dash):
        q = check_query(expr, exported, where)
        used |= q.metrics
        # A legend names only labels the query keeps (else the legend is blank)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= q.grouping_labels, f"{where}: legend {sorted(legend)} not in by ({sorted(q.grouping_labels)})"
    # And a variable's label_values() names an exported metric and one of its labels
    for v in variables(dash).values():
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)", query)
        assert m, f"variable {v['name']}: expected label_values(metric, label), got {query!r}"
        assert m.group(2) in exported.get(m.group(1), frozenset()), f"variable {v['name']}: {query}"
    # And every exported metric has a panel
    assert used == set(exported), f"metrics without a panel: {sorted(set(exported) - used)}"


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # Given every panel query as a recording rule (Grafana variables substituted)
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_w, _t, expr) in enumerate(targets(load_dashboard()))]
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    # Then Prometheus's own parser accepts every one
    out = run_promtool("check", "rules", "dashboard.yml", cwd=tmp_path)
    assert f"{len(rules)} rules found" in out


# --- the alert rules ----------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_selects_exported_metrics_and_says_what_to_do(exported: dict[str, frozenset[str]]) -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    # The brief's alerts are all there
    assert {"OutboxNotDraining", "OutboxDeadLetterUnattended", "OutboxDeadLettersGrowing", "OutboxStatsDown",
            "OutboxMetricsAbsent", "OutboxPublishFailures"} <= set(names)
    for r in rules:
        check_query(r["expr"], exported, f"alert {r['alert']}")
        assert r.get("labels", {}).get("severity") in {"critical", "warning", "info"}, r["alert"]
        assert r.get("annotations", {}).get("summary") and r["annotations"].get("description"), r["alert"]


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for name in (r["alert"] for r in alert_rules()):
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"no test where {name} fires"
        assert any(not c.get("exp_alerts") for c in mine), f"no test where {name} stays quiet"


def test_promtool_checks_the_rules() -> None:
    out = run_promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    out = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert "SUCCESS" in out
