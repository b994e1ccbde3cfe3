"""The hub's embedded store: a Redis subset for deployments without Redis (docs/data.md).

``keyspace`` is the pure data logic; ``server`` serves it over the Redis protocol on the hub's
own port, one key space per user.
"""
