"""KV: the prefix cache of recent runs (``prefix``) and the rows of a batch (``rows``)."""
