"""The asyncio/uvloop layer: the loop thread, links, the tracker client and the driver."""
