"""``python -m pacerd`` runs the CLI."""

from __future__ import annotations

from pacerd.cli import main

raise SystemExit(main())
