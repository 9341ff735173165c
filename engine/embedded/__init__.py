"""Embedded services for one machine: redis-server and etcd as child processes.

Used by ``onepiece up`` and by the test fixtures, so development and tests run
the real servers on free loopback ports, never fakes.
"""

from engine.embedded.services import EtcdServer, RedisServer, ServiceError, free_port

__all__ = ["EtcdServer", "RedisServer", "ServiceError", "free_port"]
