"""pgoutbox: PostgreSQL transactional outbox + inbox, relayed to NATS JetStream.

The database holds every rule (see sql/); this package is the thin set of
workers around it: migrations, the relay, the inbox consumer and replayer.
"""

__version__ = "0.1.0"

# The highest migration this code understands; workers refuse other schemas.
SCHEMA_VERSION = 6
