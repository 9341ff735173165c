"""The OpenAI-style video surface's extras: remix records, a finished video's still variants and its streamed mp4."""
