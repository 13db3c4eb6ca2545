"""The specdec pytest plugin (entry point ``pytest11``): ``pytest --specdec-backend NAME|module:factory``.

A separate top-level package on purpose: pytest loads plugins before the
jaxtyping import hook (``--jaxtyping-packages=specdec,...``) is installed, and
that hook refuses packages already imported, so this module imports nothing
from ``specdec`` before the session starts (after every import hook is in place).
"""
