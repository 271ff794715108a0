"""pgoutbox_spark: audited archival of outbox.events / inbox.messages / inbox.commands
days to Parquet, and the delivery report, on Spark (PySpark over JDBC).

Every rule lives in SQL (sql/91_archival_audit.sql to sql/95_archival_steps.sql);
this package only moves data:
read a sealed day over JDBC in parallel, write it to Parquet, read it back,
compute the checksum the database computes, and call the SQL steps. Run it
through `pgoutbox archive` / `pgoutbox report`, or spark-submit relay/pgoutbox/cli/submit.py.
"""
