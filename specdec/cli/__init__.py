"""The ``specdec`` command line: argument parsing (``main``) and the commands that print for a person."""
