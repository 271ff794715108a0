"""For trying pgoutbox on one machine, never for production: embedded
PostgreSQL and nats-server under a local folder (embedded), and the demo
(`make demo`: demo.py, whose inbox half is demo_inbox.py).
dev may import everything; nothing imports dev except tests, benchmarks and
the test harness (harness/, outside the wheel)."""
