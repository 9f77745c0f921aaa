"""The data planes (`--transport`) and their defaults, written once for every command.

Two defaults, on purpose: a node started alone (and compose and Kubernetes, which start
nodes alone) takes `tcp`, which binds to the address it is given and crosses hosts and
containers as-is; `tandem up` and `tandem bench compare` start every node on one host, where
`ucx` moves KV through shared memory (docs/results.md, the data plane). UCX's listener takes
no address (docs/security.md), one more reason a node alone does not default to it.
"""

from __future__ import annotations

TRANSPORTS = ("ucx", "tcp")
NODE_TRANSPORT = "tcp"  # a node alone, compose, Kubernetes
ONE_HOST_TRANSPORT = "ucx"  # tandem up, tandem bench compare
