"""LoRA adapters per request: the operators' registry (:mod:`.registry`), a request's ``lora``
field (:mod:`.request`), the hot adapters of a denoise instance (:mod:`.hot`, torch), tiny adapters for tests
and demos (:mod:`.tiny`, torch) and ``onepiece adapters`` (:mod:`.cli`). Importing this package is light."""
