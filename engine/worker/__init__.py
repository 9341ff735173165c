"""TaskManager (one per node) and TaskWorker processes; see manager.py and taskworker.py."""
