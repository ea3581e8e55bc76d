"""Tools on top of the library, each a ``pdmask`` subcommand: ``bench`` (with ``bench_hidden``'s rows) and ``demo``."""
