"""KV kept between runs: the prefix cache of recent runs (``prefix``) and the heap trim once it lets KV go."""
