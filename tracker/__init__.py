"""The rabit2 tracker and the ``rabit2-submit`` launcher."""
