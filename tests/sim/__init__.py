"""Many agents in one process over the seeded in-memory network, fault plans included."""
