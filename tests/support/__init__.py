"""What the tests share: the TCP fault proxy (``support.proxy``) and the
services' URLs (``support.services``).

Imported as ``support``: pytest puts ``tests/`` on ``sys.path`` when it loads
``tests/conftest.py`` (its default, ``prepend``, import mode)."""
