"""``python -m flows.cli`` runs ``bertpipe``."""

from flows.cli.main import main

main()
