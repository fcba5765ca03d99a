"""``python -m bunshin``: the same as the ``bunshin`` command."""

from bunshin.cli import main

raise SystemExit(main())
