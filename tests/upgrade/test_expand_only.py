"""The migrations since the previous release only expand (docs/upgrading.md):
the catalog they build still offers everything the previous release's
workers use, the way they use it. Compared catalog to catalog, a database
migrated by the previous release (taken from git history) against one
migrated by this checkout, so that a merge that breaks the rule fails here
at once, and not only when the rolling-upgrade test happens to hit it.

  * every function of the outbox and inbox schemas is still there, with the
    same arguments, result and SECURITY DEFINER, and granted to at least the
    same roles;
  * every column is still there, with the same type and NOT NULL;
  * a table whose row type a function returns (outbox.events from
    outbox.claim, inbox.messages from inbox.receive...) has exactly the same
    columns: adding one makes a call that waits on the migration's lock fail
    with SQLSTATE 42804 when the migration commits (the caller resolved the
    row type before waiting), and a consumer whose mark_processed fails that
    way calls its handler a second time;
  * outbox.serves_workers_from() still serves the previous release."""

from __future__ import annotations

import psycopg
import pytest

from support.upgrade import previous_release

pytestmark = pytest.mark.slow

SCHEMAS = ("outbox", "inbox")


def functions(conn: psycopg.Connection) -> dict[str, tuple[str, bool, frozenset[str]]]:
    """signature -> (result, SECURITY DEFINER, roles with EXECUTE); trigger
    functions left out: no worker calls them, the table's triggers do."""
    rows = conn.execute(
        """
        SELECT p.oid::regprocedure::text, pg_get_function_result(p.oid), p.prosecdef,
            coalesce(array_agg(r.rolname) FILTER (WHERE r.rolname IS NOT NULL), '{}')
        FROM pg_proc AS p
        INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
        LEFT JOIN LATERAL aclexplode(p.proacl) AS a ON a.privilege_type = 'EXECUTE'
        LEFT JOIN pg_roles AS r ON a.grantee = r.oid
        WHERE n.nspname = ANY(%s) AND p.prorettype <> 'trigger'::regtype
        GROUP BY 1, 2, 3
        """,
        (list(SCHEMAS),),
    ).fetchall()
    return {sig: (result, definer, frozenset(roles)) for sig, result, definer, roles in rows}


def columns(conn: psycopg.Connection) -> dict[str, dict[str, tuple[str, bool]]]:
    """table -> column -> (type, NOT NULL), tables and partitioned tables, not their partitions."""
    out: dict[str, dict[str, tuple[str, bool]]] = {}
    for table, column, kind, not_null in conn.execute(
        """
        SELECT format('%%I.%%I', n.nspname, c.relname), a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
        FROM pg_attribute AS a
        INNER JOIN pg_class AS c ON a.attrelid = c.oid
        INNER JOIN pg_namespace AS n ON c.relnamespace = n.oid
        WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'p') AND NOT c.relispartition
            AND a.attnum > 0 AND NOT a.attisdropped
        """,
        (list(SCHEMAS),),
    ).fetchall():
        out.setdefault(table, {})[column] = (kind, not_null)
    return out


def returned_row_types(conn: psycopg.Connection) -> dict[str, list[str]]:
    """table -> the functions that return its row type."""
    out: dict[str, list[str]] = {}
    for table, function in conn.execute(
        """
        SELECT format('%%I.%%I', tn.nspname, c.relname), p.oid::regprocedure::text
        FROM pg_proc AS p
        INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
        INNER JOIN pg_class AS c ON c.reltype = p.prorettype
        INNER JOIN pg_namespace AS tn ON c.relnamespace = tn.oid
        WHERE n.nspname = ANY(%s)
        """,
        (list(SCHEMAS),),
    ).fetchall():
        out.setdefault(table, []).append(function)
    return out


def test_the_migrations_since_the_previous_release_only_expand(tmp_path, database_url, empty_database_url):
    old = previous_release(tmp_path)
    old.run("migrate", OUTBOX_DATABASE_URL=empty_database_url)
    with (
        psycopg.connect(empty_database_url, autocommit=True) as before,
        psycopg.connect(database_url, autocommit=True) as after,
    ):
        old_functions, new_functions = functions(before), functions(after)
        old_columns, new_columns = columns(before), columns(after)
        row_types = returned_row_types(before)
        serves = after.execute("SELECT outbox.serves_workers_from()").fetchone()

    problems = []
    for sig, (result, definer, roles) in sorted(old_functions.items()):
        if sig not in new_functions:
            problems.append(f"function {sig} was dropped or its arguments changed")
            continue
        new_result, new_definer, new_roles = new_functions[sig]
        if (new_result, new_definer) != (result, definer):
            problems.append(f"function {sig} now returns {new_result} (was {result}), SECURITY DEFINER {new_definer}")
        if not roles <= new_roles:
            problems.append(f"function {sig} is no longer granted to {sorted(roles - new_roles)}")
    for table, cols in sorted(old_columns.items()):
        if table not in new_columns:
            problems.append(f"table {table} was dropped")
            continue
        for column, shape in sorted(cols.items()):
            if new_columns[table].get(column) != shape:
                problems.append(f"column {table}.{column} {shape} is now {new_columns[table].get(column)}")
        added = sorted(set(new_columns[table]) - set(cols))
        if added and table in row_types:
            problems.append(
                f"columns {added} added to {table}, whose row type {', '.join(sorted(row_types[table]))} return: "
                "calls of running workers fail once with 42804 when the migration commits; "
                "put the new data in a table of its own"
            )
    assert serves is not None and serves[0] <= old.schema_version, (
        f"outbox.serves_workers_from() is {serves}: the previous release (schema {old.schema_version}) "
        "is no longer served; that is a contract migration, for a later release"
    )
    assert old_functions and old_columns and row_types, "nothing compared"
    assert not problems, "\n".join(problems)
