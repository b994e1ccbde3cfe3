"""Continuum Mesh agent: durable local queue, warm worker pool, MQTT/ZeroMQ links to the hub.

Import cost matters on a Raspberry Pi: nothing here imports torch or a web framework.
"""

__version__ = "0.1.0"
