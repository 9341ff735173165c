"""The whole system on one machine (``onepiece up``): the embedded Redis and etcd, the web platform (Django,
started as its own processes), the tiny models and the engine, supervised together.

It lives outside ``engine/`` because it starts Django, and the engine never imports or starts the platform
(``docs/seams.md``): the engine is a library the launcher, the platform and the deployments use alike.
``engine.cli`` names this package's :mod:`onepiece_launcher.up` for its ``up`` command, imported only when
that command runs.
"""
