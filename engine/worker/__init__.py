"""TaskManager (one per node) and TaskWorker processes; see taskmanager.py and taskworker.py."""
