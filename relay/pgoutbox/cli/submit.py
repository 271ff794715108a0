"""Entry point for spark-submit: the same `pgoutbox` command line.

    spark-submit --master spark://host:7077 --jars /usr/share/java/postgresql.jar \\
        relay/pgoutbox/cli/submit.py archive --archive-uri hdfs:///archive/pgoutbox

Master and jars then come from spark-submit; every other setting from the
OUTBOX_* environment or the flags (see docs/archival.md).
"""

import sys
from pathlib import Path

# Run as a file, its folder comes first on sys.path, where the command modules
# (report, settings, ...) would stand in for top-level modules of those names.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from pgoutbox.cli.main import main  # noqa: E402  (after the path is set)

if __name__ == "__main__":
    sys.exit(main())
