"""``python -m pacerd_demo``: the live demo (see ``runner``)."""

from __future__ import annotations

import sys

from pacerd_demo.runner import main

sys.exit(main())
