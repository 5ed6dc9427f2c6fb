"""The event log's schema and its reader, at the bottom layer beside the policy: the
simulator writes this log, the runtime's scheduler writes it too, and metrics, pictures and
`explain` read it. Pure Python (no Ray, no torch).

`schema` defines the events (`validate`, `read_jsonl`, `write_jsonl`); `trace` replays a log
into jobs, runs, swaps and tiers over time (`Trace`).
"""
