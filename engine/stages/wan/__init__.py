"""Stage executors of ``wan2.1-i2v`` (Wan2.1 image-to-video)."""
