"""Lazy recovery (``docs/recovery.md``): the component an agent owns when recovery is on.

- :mod:`.store`: the results a rank retains for a restarted neighbour's replay;
- :mod:`.peer_state`: the ``state`` a neighbour sends when a link comes up, and the roles a
  restarted rank gives its neighbours for each call it replays;
- :mod:`.port`: what the component may ask of the agent that owns it, and how it sends a
  blob through it;
- :mod:`.component`: :class:`~.component.Recovery`, the link (re)connects, the state
  exchange and the replay, with its parts :mod:`.needs` (where each stream restarts),
  :mod:`.fetches` (results, checkpoints and local models asked of a neighbour, and the
  answers) and :mod:`.replicas` (local models handed along the ring).
"""
