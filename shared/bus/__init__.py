"""Control plane on NATS JetStream: connection, topology, messages, queue, registry, journal."""
