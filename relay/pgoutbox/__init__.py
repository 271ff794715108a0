"""pgoutbox: PostgreSQL transactional outbox + inbox, relayed to NATS JetStream.

The database holds every rule (see sql/); this package is the thin set of
workers around it: migrations, the relay, the inbox consumer and replayer.
"""

__version__ = "0.3.0"

# The schema this code is built for (its newest migration), and the oldest
# schema it still runs on. A newer schema is accepted while it says, through
# outbox.serves_workers_from(), that it still serves code built for
# SCHEMA_VERSION (docs/upgrading.md).
SCHEMA_VERSION = 18
OLDEST_SCHEMA = 7
