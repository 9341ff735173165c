"""A manager candidate process for the election tests: prints what happens to it, with times."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.manager.election import Election, NotLeader, connect


def main(url: str, name: str, ttl: int, key: str, owner_key: str) -> None:
    def elected(ship) -> None:
        print(f"elected {ship.token} {time.time():.3f}", flush=True)

    def deposed(ship) -> None:
        print(f"deposed {ship.token} {time.time():.3f}", flush=True)

    e = Election(connect(url), name, ttl=ttl, key=key, on_elected=elected, on_deposed=deposed).start()
    print("ready", flush=True)
    while True:
        if e.is_leader:
            try:
                token = e.fenced_put(owner_key, name)
                print(f"write ok {token} {time.time():.3f}", flush=True)
            except NotLeader:
                print(f"write refused {time.time():.3f}", flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
