"""``python -m treeverify`` — same as the ``treeverify`` console script."""

from treeverify.cli import main

raise SystemExit(main())
