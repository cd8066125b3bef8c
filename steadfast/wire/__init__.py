"""What crosses between processes: msgspec messages by channel, typed queues, CURVE.
Imports nothing else of steadfast."""
