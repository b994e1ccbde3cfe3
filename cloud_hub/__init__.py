"""Continuum Mesh hub: REST API, registry, per-endpoint durable queues, dispatcher, SDK client."""

__version__ = "0.1.0"
