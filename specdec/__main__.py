"""``python -m specdec``: the same command line as the ``specdec`` script."""

from specdec.cli.main import main

raise SystemExit(main())
