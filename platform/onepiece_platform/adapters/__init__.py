"""LoRA adapters on the platform: ``GET /v1/adapters`` for clients, the operators' registry in the admin, and
the ``lora`` request field. The registry itself is the engine's (engine.adapters.registry, its public reader
and writer); this app never builds a path into the adapter store."""
