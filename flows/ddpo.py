"""DDPO on its own: ``python -m flows.ddpo`` runs the ``ddpo`` stage (``tasks/stages/ddpo.py``, ``params.yaml:ddpo``)."""

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before flows.stage loads torch
    configure_process()

import sys  # noqa: E402

from flows.stage import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["ddpo", *sys.argv[1:]]))
