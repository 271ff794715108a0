"""The test harness: servers and tools that the tests, chaos/ and bench/
start around the product (a TCP proxy that cuts connections, a streaming
standby, a three-node NATS cluster, an OTLP receiver, an earlier commit's
package). Not in the wheel: imported from the checkout's root, as chaos/ is."""
