"""The pure core of rabit2: no sockets, no asyncio, no clock reads (time is a parameter)."""
