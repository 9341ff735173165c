"""The data plane: one-sided memory regions (shm, tcp, verbs) and the double ring buffer over them."""
