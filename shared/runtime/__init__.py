"""The service runtime: what any Tandem service needs to start, serve and stop.

`options` (command-line options that also read `TANDEM_*` variables), `node` (identity,
logs, tracing, bus, signals, registry heartbeat), `service` (run a service's coroutine
with a bounded end) and `engine` (threads and the engine of a model-serving node; the
only module here that loads torch). Services import this; nothing here imports a service
or the `tandem` command.
"""
