"""DDPO on its own: ``python -m flows.ddpo`` runs the ``ddpo`` stage (``tasks/ddpo.py``, ``params.yaml:ddpo``)."""

import sys

from flows.stage import main

if __name__ == "__main__":
    sys.exit(main(["ddpo", *sys.argv[1:]]))
