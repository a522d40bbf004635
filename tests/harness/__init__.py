"""The conformance harness itself (conformance/harness/): its spec reader, plugin and backends."""
