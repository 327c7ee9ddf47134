"""Real processes and real sockets on this host: engines, the tracker, the launcher, jobs."""
