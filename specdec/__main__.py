"""``python -m specdec``: the same command line as the ``specdec`` script."""

from specdec.cli.main import main

if __name__ == "__main__":  # importing the module (as a package walk does) runs nothing
    raise SystemExit(main())
