"""``python -m ralph_mail``: the ``ralph-mail`` command line."""

from ralph_mail.cli import main

raise SystemExit(main())
