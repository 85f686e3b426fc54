"""``python -m palaestra`` runs the command-line interface."""

from palaestra.cli import main

raise SystemExit(main())
