"""Stage executors of ``sd-t2i`` (Stable Diffusion 1.x text-to-image)."""
