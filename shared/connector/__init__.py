"""Where the engine meets the planes: the KV connector (docs/architecture.md, "The engine
seam"). The engine (shared/engine/) knows no wire type, no bus and no kvcache client; the
planes (shared/bus/, shared/kvclient/, shared/transport/) know no engine. What joins them
lives here: the mapping between the engine's types and the wire's, the engine's pool
events published as KV events, and prefix loads from the kvcache service."""
