"""``python -m rabit2.examples.gbdt``: see the package documentation."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
