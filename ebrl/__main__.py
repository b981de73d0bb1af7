"""``python -m ebrl`` is the ``ebrl`` command (also what ``torchrun -m ebrl`` runs)."""

import sys

from ebrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
