"""For trying pgoutbox on one machine, never for production: embedded
PostgreSQL and nats-server under a local folder (embedded), and the demo
(`make demo`: demo for the outbox half, consumer_demo for the inbox half).
dev may import everything; nothing imports dev except tests and benchmarks."""
