"""`tandem bench`: one load generator for tandem's gRPC API and OpenAI-compatible HTTP servers.

    config (what to send) → workload (the requests, in order, from a seed) → runner (sends them
    at a concurrency or a Poisson rate, times every message into a record) → metrics (records →
    summaries) → report (table, JSON) and plot (PNG).

The same seed replays the same requests against every target, one target after the other, so
the servers are measured by the same client in the same run.
"""
