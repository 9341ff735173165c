"""Third-party chatter off for the engine's own command-line work.

diffusers and transformers draw a progress bar per component they load or save
("Loading weights", "Writing model shards") and log warnings meant for their
own users (a missing optional torchvision, deprecations); interleaved with our
commands' progress bars and output they drown them. Commands that load or build
models call :func:`quiet_libraries` once, before the work; errors still show.
"""

from __future__ import annotations


def quiet_libraries() -> None:
    """diffusers' and transformers' progress bars off and their logging at ERROR (imports them)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
