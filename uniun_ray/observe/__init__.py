"""Looking at a running (or finished) scheduler: the status view and one job's story.

Pure functions over the scheduler's snapshot and its event log, so they are tested without
Ray and work on a log copied from another machine; the CLI only fetches and prints.
"""
