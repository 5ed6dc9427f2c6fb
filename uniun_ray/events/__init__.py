"""The event log's schema and its reader, at the bottom layer beside the policy: the
simulator writes this log, the runtime's scheduler writes it too, and metrics, pictures and
`explain` read it. Pure Python (no Ray, no torch).

`schema` defines the events (`validate`); `log` is the file (`EventLog` appends and
rotates, `write` writes a whole run, `read` and `tail` read one back); `trace` replays a log
into jobs, runs, swaps and tiers over time (`Trace`).
"""
