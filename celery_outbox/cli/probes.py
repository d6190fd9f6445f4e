"""``outbox check``: the readiness probe from a shell, a cron job or a container healthcheck.

Exit codes, shared by every command that can fail a probe (``outbox check``, ``outbox stats`` with a
threshold):

====  ==========================================================================================
0     all good
1     the command itself failed (database unreachable for ``stats``, an unexpected error); one line
2     usage or configuration error (a bad flag, a bad ``OUTBOX_*`` setting)
3     the command ran and found a problem: a failed readiness check, a crossed ``stats`` threshold
====  ==========================================================================================
"""

from __future__ import annotations

import click

from celery_outbox.celery.probe import DEFAULT_TIMEOUT_S, broker_probe
from celery_outbox.cli.common import Duration, echo_json, get_outbox, handle_errors, one_line
from celery_outbox.ops import health, postgres_checks

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEM = 3


@click.command("check")
@click.option("--no-broker", is_flag=True, help="Skip the broker check (a process that never publishes).")
@click.option("--timeout", "timeout_ms", type=Duration(), default=f"{int(DEFAULT_TIMEOUT_S * 1000)}ms",
              show_default=True, help="How long the broker may take to accept a connection.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one JSON document).")
@click.pass_context
@handle_errors
def check(ctx: click.Context, no_broker: bool, timeout_ms: int, as_json: bool) -> None:
    """Readiness: database reachable, schema at this library's head revision, broker reachable; on Postgres
    also the role's grants (a missing one fails), its timeouts and a transaction pooler in between (warnings).
    Exit 0 when all pass, 3 with one line per failed check otherwise (see docs/operations.md, "Probes and exit codes")."""
    if timeout_ms <= 0:
        raise click.BadParameter("must be > 0", param_hint="--timeout")
    outbox = get_outbox(ctx)
    probe = None if no_broker else broker_probe(outbox.broker_url, timeout_s=timeout_ms / 1000, settings=outbox.settings)
    result = health.readiness(outbox.sessions(), prefix=outbox.settings.table_prefix, broker=probe,
                              upgrade_command=outbox.schema_command)
    # On Postgres, once it answers: the role's grants, its timeouts and a pooler in between (ops/postgres_checks.py)
    findings = (postgres_checks.production_checks(outbox.sessions(), tables=outbox.tables, settings=outbox.settings)
                if result.checks[0].ok else [])
    ok = result.ok and all(f.ok for f in findings)
    if as_json:
        doc = result.to_dict()
        doc["ready"] = ok
        doc["findings"] = [f.to_dict() for f in findings]
        doc["failed"] = [*doc["failed"], *(f.name for f in findings if not f.ok)]
        echo_json(doc)
    elif ok:
        click.echo("ready: " + ", ".join(f"{c.name} ok" for c in result.checks))
    for c in result.failed:
        click.echo(one_line(c.line()), err=True)  # one_line masks a password a driver message might carry
    for f in findings:
        if f.level != "ok":
            click.echo(("" if f.level == "failed" else "warning: ") + one_line(f.line()), err=True)
    if not ok:
        raise click.exceptions.Exit(EXIT_PROBLEM)
