"""Entry point for spark-submit: the same `pgoutbox` command line.

    spark-submit --master spark://host:7077 --jars /usr/share/java/postgresql.jar \\
        spark/pgoutbox_spark/submit.py archive --archive-uri hdfs:///archive/pgoutbox

Master and jars then come from spark-submit; every other setting from the
OUTBOX_* environment or the flags (see docs/archival.md).
"""

import sys

from pgoutbox.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
