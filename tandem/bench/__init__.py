"""`tandem bench`: a streaming load generator for OpenAI-compatible servers, and comparisons.

workload (what to send) → loadgen + client (send it, timestamp every chunk) → metrics (pure
functions over those timelines) → report (JSON, tables, PNG plots). `serve` drives one
endpoint through a rate sweep; `compare` runs the same sweep against a colocated and a
disaggregated stack on the same cores.
"""
