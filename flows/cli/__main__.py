"""``python -m flows.cli`` runs ``bertpipe``."""

from flows.cli import main

main()
