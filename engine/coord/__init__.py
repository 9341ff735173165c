"""Coordination through etcd: the one owner of the engine's etcd keyspace.

- :mod:`engine.coord.client`: the client every engine process and the platform use
  (:func:`etcd_client`): fails over between a cluster's members, authenticates with the
  credentials in the URL, TLS from the environment.
- :mod:`engine.coord.auth`: turning etcd's authentication on for the engine (``onepiece
  etcd-auth``, and ``onepiece up`` for its embedded etcd).
- :mod:`engine.coord.keys` (every key), :mod:`engine.coord.watch` (prefix watches).
- :mod:`engine.coord.routes`: the instances' route tables (TaskManagers publish, workers and
  the Proxy read); :mod:`engine.coord.proxies`: the Proxies' registration and which Proxy
  a client uses; :mod:`engine.coord.actions`: the operators' action queue.

Importing this package imports no third-party module (``etcd3gw`` and ``requests`` load
when a client is made).
"""

from __future__ import annotations

from typing import Any

from engine.coord.client import EtcdAuthError, FailoverClient, redact

__all__ = ["EtcdAuthError", "FailoverClient", "etcd_client", "redact"]


def etcd_client(url: str, timeout: float = 5.0) -> Any:
    """A client for ``http[s]://[user:password@]host:port`` or a comma-separated list of a cluster's members."""
    return FailoverClient(url, timeout)
